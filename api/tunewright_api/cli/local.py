"""The API on this machine for the length of one command (`tunewright train`, `make demo`): `tunewright serve`
as a child process on a free loopback port, on a data folder it is given, stopped through the handle this
process holds (never a server found on the host, never one found by searching processes). Where the folder
already has its API (`serve` running on it: backends.local_folder), the command uses that one and leaves it up."""

from __future__ import annotations

import contextlib
import os
import secrets
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

from tunewright_api.cli.client import Client, RequestFailed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def admin_token_file(data_dir: Path) -> Path:
    """Where `serve` keeps the admin token of a data folder when the settings give none (made once, owner-only):
    every server of that folder uses the same one, so starting one never retires the token of another."""
    token_file = data_dir / "admin.token"
    data_dir.mkdir(parents=True, exist_ok=True)
    if not token_file.exists():
        token_file.touch(mode=0o600)
        token_file.write_text("tw-" + secrets.token_urlsafe(32))
    return token_file


class LocalApi:
    """`with LocalApi(data_dir, admin_token, log_path) as api:` the API up at `api.url` (local backend), its
    output in `log_path`; stopped when the block ends, however it ends. With `serving`, the URL of the API that
    already serves the folder: that one is used (`api.started` False) and left as it is."""

    def __init__(self, data_dir: Path, admin_token: str, log_path: Path, serving: str | None = None):
        self.data_dir, self.log_path = data_dir.resolve(), log_path
        self.started = serving is None
        self.url = serving or f"http://127.0.0.1:{free_port()}"
        self.admin = Client(self.url, admin_token)
        self.env = {**os.environ, "TUNEWRIGHT_DATA_DIR": str(self.data_dir), "TUNEWRIGHT_ADMIN_TOKEN": admin_token,
                    "TUNEWRIGHT_PUBLIC_URL": self.url, "TUNEWRIGHT_BACKEND": "local",
                    "TOKENIZERS_PARALLELISM": "false"}
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> LocalApi:
        if not self.started:
            self.wait_healthy(timeout=10)
            self.check_admin()
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("w") as log:
            # a session of its own: Ctrl-C reaches this process only, which cancels its job before stopping the API
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tunewright_api.cli", "serve", "--port", self.url.rsplit(":", 1)[1]],
                env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_healthy(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.admin.request("GET", "/healthz")
                return
            except RequestFailed as err:
                if self.process is None:  # the folder's own API: it answers (or is stopping) or it does not
                    if time.monotonic() > deadline:
                        raise RequestFailed(f"the API serving {self.data_dir} at {self.url} does not answer ({err}): "
                                            "try again once it is up, or stop it") from None
                    time.sleep(0.2)
                    continue
                code = self.process.poll()
                if code is not None:
                    raise RequestFailed(f"the API on this machine exited with code {code} as it started: its log "
                                        f"is {self.log_path}") from None
                if time.monotonic() > deadline:
                    raise RequestFailed(f"the API on this machine did not answer within {timeout:.0f} s: its log "
                                        f"is {self.log_path}") from None
                time.sleep(0.2)

    def check_admin(self) -> None:
        """The folder's running API knows this command's admin token (it may have been started with another)."""
        try:
            self.admin.request("GET", "/v1/tokens", params={"limit": 1})  # admin only
        except RequestFailed as err:
            if err.status not in (401, 403):
                raise
            raise RequestFailed(f"the API serving {self.data_dir} at {self.url} was started with another admin token "
                                "than this command has: give this command that one (TUNEWRIGHT_ADMIN_TOKEN), or submit "
                                f"to it with a tenant's token (tunewright --url {self.url} --token ... submit)",
                                status=401) from None

    def stop(self) -> None:
        """Asked to stop, then killed if it has not within 30 s (or a second Ctrl-C comes first). Running jobs
        would go on without it (a restarted API re-attaches to them): the caller ends its job first."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=30)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()

    def tenant_token(self, tenant: str, kept_in: Path | None = None) -> str:
        """A token of `tenant`. With `kept_in`, the one kept in that file (owner-only) while this API knows it,
        else a new one kept there: runs on one data folder share a tenant, and the user one token."""
        if kept_in is not None and kept_in.is_file():
            token = kept_in.read_text().strip()
            try:
                Client(self.url, token).request("GET", "/v1/files", params={"limit": 1})
                return token
            except RequestFailed as err:
                if err.status != 401:  # only a token this API does not know is replaced
                    raise
        token = self.admin.request("POST", "/v1/tokens", json={"tenant": tenant})["token"]
        if kept_in is not None:
            kept_in.touch(mode=0o600)
            kept_in.write_text(token)
        return token


def dashboard_url(url: str, token: str, job_id: str) -> str:
    """The job's page on the dashboard, signed in: the token rides in the fragment, which the browser never sends
    (the page moves it to the tab's storage and clears it from the address bar)."""
    return f"{url}/ui/#token={token}&to=/jobs/{job_id}"


def serve_again(data_dir: Path, token: str, job_id: str) -> str:
    """How to look at the job once its API has stopped: an API on the same data, and the page's link."""
    tunewright = Path(sys.executable).with_name("tunewright")
    command = shlex.quote(str(tunewright)) if tunewright.exists() else f"{shlex.quote(sys.executable)} -m tunewright_api.cli"
    return (f"dashboard, later   the API has stopped; to open the job again, serve its data:\n"
            f"                   TUNEWRIGHT_DATA_DIR={shlex.quote(str(data_dir))} {command} serve --port 8000\n"
            f"                   then open {dashboard_url('http://127.0.0.1:8000', token, job_id)}")
