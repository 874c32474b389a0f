"""Starts a local job's run at most once per run folder, whatever instant the API dies at while launching.

Run by path, as `python local_launcher.py RUN_DIR COMMAND...` (standard library only: it starts in a blink
and imports nothing of the API). It takes the folder's lock, then claims the folder by creating `run.pid`
(refusing when it exists: a run already started there), then becomes COMMAND with the lock's file still
open, so the run holds the lock for as long as it lives. The API tells a live run by its lock being held
(a reused pid cannot fool that) and finds the run's process group, whose leader this is, in `run.pid`.
"""

from __future__ import annotations

import fcntl
import os
import sys
import time

LOCK_FILE = "run.lock"
PID_FILE = "run.pid"
REFUSED = 75  # exit status: another run has this folder, nothing was started
LOCK_WAIT_SECONDS = 2.0  # the API probes the lock for an instant; a run holds it for its whole life


def exclusive_lock(path: str, wait: float = LOCK_WAIT_SECONDS) -> int | None:
    """The file's exclusive lock (made owner-only if missing), taken within `wait` seconds: the descriptor that
    holds it, until closed or the process ends; None if another holds it."""
    lock = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return lock
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(lock)
                return None
            time.sleep(0.01)


def lock_held(path: str) -> bool:
    """Whether another holds the file's lock (probed for an instant, not waited for)."""
    try:
        probe = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(probe)  # also lets go of the lock if the probe took it
    return False


def claim(run_dir: str) -> int | None:
    """The folder's lock, held, once this process is recorded as the folder's one run; None if another is."""
    lock = exclusive_lock(os.path.join(run_dir, LOCK_FILE))
    if lock is None:
        return None
    # written whole under another name, then linked: `run.pid` never exists empty, and linking fails if it exists
    partial = os.path.join(run_dir, f"{PID_FILE}.{os.getpid()}")
    with open(partial, "w") as out:
        out.write(str(os.getpid()))
    try:
        os.link(partial, os.path.join(run_dir, PID_FILE))
    except FileExistsError:
        os.close(lock)
        return None
    finally:
        os.unlink(partial)
    return lock


def main(argv: list[str]) -> int:
    run_dir, command = argv[1], argv[2:]
    lock = claim(run_dir)
    if lock is None:
        print(f"tunewright: a run of this job already started in {run_dir}: this launch did nothing",
              file=sys.stderr, flush=True)
        return REFUSED
    os.set_inheritable(lock, True)  # through exec: the run holds the lock until its last breath
    os.execv(command[0], command)  # becomes the run (same pid: still the group's leader), or raises


if __name__ == "__main__":
    sys.exit(main(sys.argv))
