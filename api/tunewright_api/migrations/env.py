"""Alembic environment: the URL comes from the caller (db.migrate) or TUNEWRIGHT_DATABASE_URL."""

from alembic import context
from sqlmodel import SQLModel

from tunewright_api import models  # noqa: F401  (registers the tables)

config = context.config
target_metadata = SQLModel.metadata


def run_migrations() -> None:
    connectable = config.attributes.get("connection")
    if connectable is None:
        from tunewright_api.db import make_engine

        engine = make_engine(config.get_main_option("sqlalchemy.url"))
        with engine.connect() as connection:
            _run(connection)
        engine.dispose()
    else:
        _run(connectable)


def _run(connection) -> None:
    context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True,
                      compare_type=True, render_item=models.render_for_alembic)
    with context.begin_transaction():
        context.run_migrations()


run_migrations()
