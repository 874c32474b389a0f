"""Engine and sessions. SQLite by default, PostgreSQL through TUNEWRIGHT_DATABASE_URL."""

from __future__ import annotations

from collections.abc import Iterator

from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlmodel import Session, SQLModel, create_engine


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(connection, _record):  # concurrent readers while the backend writes
            cursor = connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()

        return engine
    return create_engine(url, pool_pre_ping=True)


def create_schema(engine: Engine) -> None:
    from tunewright_api import models  # noqa: F401  (registers the tables)

    SQLModel.metadata.create_all(engine)


def sessions(engine: Engine) -> Iterator[Session]:
    with Session(engine) as session:
        yield session
