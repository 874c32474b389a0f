"""Datasets named by URL (on a cluster, a file uploaded to the tunewright API), fetched once before training.

The request carries the job's own token (TUNEWRIGHT_TELEMETRY_TOKEN): the API serves a job only the files
its spec names, of its own tenant. The copy lands in `<output_dir>/data`, which every pod of the job sees
(on a cluster the output is on the checkpoint volume they all mount), under its final name only once
complete.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from pathlib import Path

from tunewright_jobs.config import JobConfig
from tunewright_jobs.dataset_files import DatasetError

MAX_DATASET_BYTES = 64 * 2**30
CHUNK_BYTES = 1 << 20
TIMEOUT_SECONDS = 60


def is_url(source: str | None) -> bool:
    return bool(source) and source.startswith(("http://", "https://"))


def localize_datasets(cfg: JobConfig) -> JobConfig:
    """`cfg` with its URL datasets replaced by local copies (unchanged when it names none)."""
    wanted = {key: getattr(cfg.dataset, key) for key in ("train", "validation") if is_url(getattr(cfg.dataset, key))}
    if not wanted:
        return cfg
    folder = Path(cfg.output_dir) / "data"  # on a cluster, output_dir is on the volume every pod mounts
    folder.mkdir(parents=True, exist_ok=True)
    token = os.environ.get("TUNEWRIGHT_TELEMETRY_TOKEN", "")
    local = {key: str(fetch(url, folder / f"{key}.jsonl", token, f"dataset.{key}")) for key, url in wanted.items()}
    return cfg.model_copy(update={"dataset": cfg.dataset.model_copy(update=local)})


def fetch(url: str, dest: Path, token: str, field: str, max_bytes: int = MAX_DATASET_BYTES) -> Path:
    if dest.exists():  # another rank (or an earlier attempt of this job) fetched it already
        return dest
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    partial = dest.with_name(f".{dest.name}.{os.getpid()}.partial")
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_SECONDS) as response, partial.open("wb") as out:
            written = 0
            while chunk := response.read(CHUNK_BYTES):
                written += len(chunk)
                if written > max_bytes:
                    raise DatasetError(f"{field}: {url} is larger than {max_bytes} bytes")
                out.write(chunk)
        partial.replace(dest)
    except urllib.error.HTTPError as err:
        detail = err.read(2000).decode(errors="replace")
        raise DatasetError(f"{field}: {url} answered {err.code}: {detail}") from None
    except OSError as err:
        raise DatasetError(f"{field}: cannot fetch {url}: {err}") from None
    finally:
        partial.unlink(missing_ok=True)
    return dest
