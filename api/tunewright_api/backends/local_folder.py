"""One local API per data folder. The local backend's scheduler, its queue limit and its Ray are the folder's:
two APIs on one folder would each admit `max_running_jobs` and each settle the other's runs. So the API that
starts on a folder holds its lock (`server.lock`) for its life and records where it answers (`server.json`);
another `serve` on that folder is refused, saying which API has it, and `tunewright train` submits to that API
instead of starting one of its own. The lock goes with the process however it ends, so a killed API leaves
nothing that refuses the next one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tunewright_api.backends.local_launcher import exclusive_lock, lock_held

LOCK_FILE = "server.lock"
RECORD_FILE = "server.json"


class FolderServed(RuntimeError):
    """The data folder already has its API."""


def claim(data_dir: Path, url: str) -> int:
    """The folder's lock, held (the descriptor, closed by `release` or with the process), and `url` recorded
    as where its API answers; FolderServed if another API holds it."""
    lock = exclusive_lock(str(data_dir / LOCK_FILE))  # a probe (`serving_url`) holds it for an instant at most
    if lock is None:
        other = recorded(data_dir)
        where = f"process {other['pid']} at {other['url']}" if other else "its record unreadable"
        use = f"use it (tunewright --url {other['url']} ...)" if other else "use it"
        raise FolderServed(f"the data folder {data_dir} is served by another tunewright API ({where}): {use}, or "
                           "give this one a folder of its own (TUNEWRIGHT_DATA_DIR)")
    partial = data_dir / f".{RECORD_FILE}.partial"
    partial.unlink(missing_ok=True)
    with os.fdopen(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as out:
        out.write(json.dumps({"pid": os.getpid(), "url": url}))
    os.replace(partial, data_dir / RECORD_FILE)
    return lock


def release(data_dir: Path, lock: int) -> None:
    """The record removed, then the lock let go: a reader never finds a record without its API."""
    (data_dir / RECORD_FILE).unlink(missing_ok=True)
    os.close(lock)


def recorded(data_dir: Path) -> dict | None:
    try:
        record = json.loads((data_dir / RECORD_FILE).read_text())
        return record if isinstance(record, dict) and {"pid", "url"} <= record.keys() else None
    except (OSError, ValueError):
        return None


def serving_url(data_dir: Path) -> str | None:
    """Where the API that holds the folder answers, if one does (its lock is held); None otherwise."""
    if not lock_held(str(data_dir / LOCK_FILE)):
        return None
    record = recorded(data_dir)
    return record["url"] if record else None
