"""Uploads under bad input and load: a non-UTF-8 line is refused naming it and leaves nothing behind, no
database connection is held while a file is validated, the validator's memory does not grow with the
file, and stored files are the owner's only (issue 15, items 2 and 7)."""

import json
import subprocess
import sys

from tests.api.conftest import TRAIN, upload
from tunewright_api.services import files

GOOD_LINE = TRAIN.read_bytes().splitlines(keepends=True)[0]


def test_a_non_utf8_line_is_refused_naming_it_and_nothing_stays_behind(server, tmp_path):
    alice = server.tenant("alice")
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(GOOD_LINE + b'{"messages": "caf\xe9"}\n' + GOOD_LINE)
    response = upload(alice, bad, "mine.jsonl")
    assert response.status_code == 400, response.text
    assert "mine.jsonl:2: not UTF-8 text (byte 18 of the line)" in response.json()["error"]["message"]
    assert [p for p in (server.settings.data_dir / "files").rglob("*") if p.is_file()] == []


def test_no_database_connection_is_held_while_a_file_is_validated(server, monkeypatch):
    engine, held = server.app.state.engine, []
    validate = files.validate_dataset

    def watching(path):
        held.append(engine.pool.checkedout())
        return validate(path)

    monkeypatch.setattr(files, "validate_dataset", watching)
    assert upload(server.tenant("alice"), TRAIN).status_code == 200
    assert held == [0]


def test_stored_files_are_the_owners_only(server):
    upload(server.tenant("alice"), TRAIN)
    (stored,) = (server.settings.data_dir / "files").rglob("*.jsonl")
    assert stored.stat().st_mode & 0o077 == 0


def test_the_validators_memory_does_not_grow_with_the_file(tmp_path):
    big = tmp_path / "big.jsonl"
    with big.open("wb") as out:
        for _ in range(48 * 2**20 // len(GOOD_LINE)):  # ~48 MB of chat examples
            out.write(GOOD_LINE)
    # the probe reads its own peak (VmHWM: this process image's; getrusage's maxrss would carry the forking
    # test process's peak across the exec)
    probe = ("import json, sys; from pathlib import Path; from tunewright_jobs.validate import validate; "
             "result = validate(Path(sys.argv[1]), 'auto'); "
             "peak = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM:')); "
             "print(json.dumps([result, peak]))")
    done = subprocess.run([sys.executable, "-c", probe, str(big)], capture_output=True, text=True, timeout=300)
    result, peak_kib = json.loads(done.stdout)
    assert result["format"] == "chat" and result["examples"] > 10_000
    assert peak_kib < 100 * 1024, f"the validator peaked at {peak_kib / 1024:.0f} MiB on a 48 MB file"


def test_the_sqlite_database_is_the_owners_only(tmp_path):
    from tests.api.conftest import Server

    with Server(tmp_path / "data", local_ray=False) as api:
        api.tenant("alice")
        modes = {db.name: db.stat().st_mode & 0o777 for db in (tmp_path / "data").glob("tunewright.db*")}
    assert "tunewright.db" in modes and all(mode & 0o077 == 0 for mode in modes.values()), modes
