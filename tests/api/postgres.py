"""A throwaway PostgreSQL server (Debian's package) for the API suite: initdb, start, yield a URL, stop."""

import glob
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path


def _binary(name: str) -> str | None:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return found[-1] if found else shutil.which(name)


def _as_postgres(command: list[str]) -> list[str]:
    # PostgreSQL refuses to run as root; CI runs as root
    return ["runuser", "-u", "postgres", "--", *command] if os.geteuid() == 0 else command


class PostgresServer:
    def __init__(self, root: Path):
        self.initdb, self.pg_ctl = _binary("initdb"), _binary("pg_ctl")
        self.root = root
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]

    @property
    def available(self) -> bool:
        return bool(self.initdb and self.pg_ctl)

    def start(self) -> str:
        data = self.root / "pgdata"
        self.root.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres")
        subprocess.run(_as_postgres([self.initdb, "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8"]),
                       check=True, capture_output=True)
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        subprocess.run(_as_postgres([self.pg_ctl, "-D", str(data), "-o", options, "-l", str(self.root / "log"),
                                     "-w", "start"]), check=True, capture_output=True)
        url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"
        deadline = time.monotonic() + 30
        import psycopg

        while True:
            try:
                psycopg.connect(f"postgresql://postgres@127.0.0.1:{self.port}/postgres").close()
                return url
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def create_database(self, name: str) -> str:
        import psycopg

        with psycopg.connect(f"postgresql://postgres@127.0.0.1:{self.port}/postgres", autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        subprocess.run(_as_postgres([self.pg_ctl, "-D", str(self.root / "pgdata"), "-m", "fast", "stop"]),
                       capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)  # the test made it; the shared machine keeps nothing
