"""The local backend's Ray: one cluster of the server's own, kept for the server's life, so a queued job
joins it in seconds instead of starting a Ray of its own (tens of seconds on a small machine, for each job).

Never one found on the host: the head is started here with token authentication (a token of its own: Ray
listens beyond loopback, and whoever reaches it runs code as this server), recorded in the data folder
(`ray.json`, owner-only: its process, address, session folder and token) and adopted by a restarted API only when that record's process still
lives and its address answers. A head that died is started again before the next job. The API stops it
when it stops with no job running; with jobs running it stays for them, and the next API adopts it. Two APIs on
one data folder (`serve`, and `tunewright train` beside it) take turns through a lock on the folder
(`ray.lock`): the second adopts the head the first started instead of starting one of its own.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)
STATE_FILE = "ray.json"
LOCK_FILE = "ray.lock"  # held while a head is looked up, started or stopped, by whichever API on the folder
SESSION_PREFIX = "tw-ray-"  # its session folder, under the system's temporary folder
START_SECONDS = 120.0  # a cold head on a busy 2-core machine takes 10-30 s


@dataclass(frozen=True)
class Head:
    pid: int  # `ray start --block`, leader of the head's process group
    address: str  # host:port of its GCS
    temp_dir: str  # its session folder (ours: removed when it stops)
    token: str  # its authentication token (RAY_AUTH_TOKEN), which a job's driver shows it


def auth_environment(token: str) -> dict[str, str]:
    """What a process needs to join the head (its drivers, and the head itself)."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}


def answers(address: str, timeout: float = 1.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def our_folder(path: str) -> bool:
    folder = Path(path)
    return folder.parent == Path(tempfile.gettempdir()) and folder.name.startswith(SESSION_PREFIX)


def is_ours(head: Head) -> bool:
    """Whether the recorded process is still our head (a pid is reused after it ends, or after a reboot):
    a session folder of the kind this API makes, named by the process's own --temp-dir argument."""
    if not our_folder(head.temp_dir):
        return False  # not a record this API wrote: nothing it names is signalled or removed
    try:
        arguments = Path(f"/proc/{head.pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return False
    return f"--temp-dir={head.temp_dir}" in arguments


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def head_command(port: int, temp_dir: str, cpus: int, gpus: int) -> list[str]:
    return [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", f"--port={port}",
            "--node-ip-address=127.0.0.1", f"--num-cpus={cpus}", f"--num-gpus={gpus}", f"--temp-dir={temp_dir}",
            "--include-dashboard=false", "--disable-usage-stats", "--block"]


class ServerRay:
    """The head, started on first need and kept; `head()` is safe to call from any thread."""

    def __init__(self, data_dir: Path, cpus: int, gpus: int, environment: dict[str, str]):
        self.state = data_dir / STATE_FILE
        self.lock_path = data_dir / LOCK_FILE
        self.log_path = data_dir / "ray.log"
        self.cpus, self.gpus, self.environment = cpus, gpus, environment
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None

    def head(self) -> Head:
        """The head: the recorded one where it lives and answers, else a new one."""
        with self._lock, self._folder_locked():
            head = self._recorded()
            if head is not None and is_ours(head) and answers(head.address):
                return head
            if head is not None:
                self._stop(head)  # died or stuck: what is left of it goes, with its session folder
            return self._start()

    def stop(self) -> None:
        with self._lock, self._folder_locked():
            head = self._recorded()
            if head is not None:
                self._stop(head)

    @contextlib.contextmanager
    def _folder_locked(self) -> Iterator[None]:
        """The data folder's turn, across processes (the thread lock orders this one's threads): an exclusive
        lock on its own file, released with it however the process ends."""
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def _recorded(self) -> Head | None:
        try:
            return Head(**json.loads(self.state.read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def _start(self) -> Head:
        # short: the session folder holds Unix sockets, whose paths are at most 107 bytes
        temp_dir = tempfile.mkdtemp(prefix=SESSION_PREFIX)
        port, token = free_port(), secrets.token_hex(32)
        with self.log_path.open("ab") as out:
            self._proc = subprocess.Popen(head_command(port, temp_dir, self.cpus, self.gpus), stdout=out,
                                          stderr=subprocess.STDOUT, env={**self.environment, **auth_environment(token)},
                                          start_new_session=True)
        head = Head(self._proc.pid, f"127.0.0.1:{port}", temp_dir, token)
        self._record(head)  # before waiting: a crash meanwhile leaves it findable
        deadline = time.monotonic() + START_SECONDS
        while not answers(head.address):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self._stop(head)
                raise OSError(f"the server's Ray did not start (see {self.log_path})")
            time.sleep(0.2)
        log.info("started the server's Ray at %s (process %d)", head.address, head.pid)
        return head

    def _record(self, head: Head) -> None:
        """Written whole and owner-only (it holds the token), whatever was there before."""
        partial = self.state.with_name(f".{self.state.name}.partial")
        partial.unlink(missing_ok=True)
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(json.dumps(asdict(head)))
        os.replace(partial, self.state)

    def _stop(self, head: Head) -> None:
        """Its whole process group (GCS, raylet, workers): asked, then killed; its session folder removed.
        A record whose process is no longer ours only goes (nothing is signalled)."""
        try:
            if not is_ours(head):
                raise ProcessLookupError
            os.killpg(head.pid, signal.SIGTERM)
            deadline = time.monotonic() + 15
            while alive(head.pid) and time.monotonic() < deadline:
                if self._proc is not None and self._proc.pid == head.pid:
                    self._proc.poll()  # our child: reaped as it ends
                time.sleep(0.1)
            os.killpg(head.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self._proc is not None and self._proc.pid == head.pid:
            self._proc.wait(timeout=10)
            self._proc = None
        if our_folder(head.temp_dir):
            shutil.rmtree(head.temp_dir, ignore_errors=True)
        self.state.unlink(missing_ok=True)
