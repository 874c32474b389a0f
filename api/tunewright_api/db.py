"""Engine and sessions. SQLite by default, PostgreSQL through TUNEWRIGHT_DATABASE_URL."""

from __future__ import annotations

import os
from pathlib import Path

from alembic import command
from alembic.config import Config as AlembicConfig
from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlmodel import create_engine

# Every request handler runs in one of anyio's 40 worker threads and may hold a connection for its
# duration; the backend's loop holds one more. A pool smaller than that makes a burst of requests wait for
# connections (and time out) while the machine idles.
POOL = {"pool_size": 20, "max_overflow": 30, "pool_timeout": 10}


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
        path = Path(url.removeprefix("sqlite:///"))
        path.parent.mkdir(parents=True, exist_ok=True)
        # owner-only: tokens' hashes and every tenant's jobs (SQLite gives its WAL files the same mode)
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False}, **POOL)

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(connection, _record):  # concurrent readers while the backend writes
            cursor = connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()

        return engine
    return create_engine(url, pool_pre_ping=True, **POOL)


MIGRATIONS = Path(__file__).with_name("migrations")


def alembic_config(url: str) -> AlembicConfig:
    config = AlembicConfig()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def migrate(engine: Engine, revision: str = "head") -> None:
    """Bring the schema to `revision` (the newest by default); an upgrade keeps the data."""
    with engine.begin() as connection:
        config = alembic_config(engine.url.render_as_string(hide_password=False))
        config.attributes["connection"] = connection
        command.upgrade(config, revision)
