"""Schema migrations: the newest revision is exactly the models, and upgrading keeps the data."""

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlmodel import Session, SQLModel, select

from tunewright_api.auth import issue_token
from tunewright_api.db import make_engine, migrate
from tunewright_api.models import GpuPool, Tenant


def url_for(database_url, tmp_path):
    return database_url or f"sqlite:///{tmp_path / 'db.sqlite'}"


def test_migrations_build_exactly_the_models(database_url, tmp_path):
    engine = make_engine(url_for(database_url, tmp_path))
    migrate(engine)
    with engine.connect() as connection:
        differences = compare_metadata(MigrationContext.configure(connection, opts={"compare_type": True}),
                                       SQLModel.metadata)
    engine.dispose()
    assert differences == [], "models.py changed without a migration: add one with alembic --autogenerate"


def test_an_upgrade_keeps_the_data(database_url, tmp_path):
    engine = make_engine(url_for(database_url, tmp_path))
    migrate(engine, "0001")  # a database from the first release
    with Session(engine) as session:
        issue_token(session, "kept")
    migrate(engine)
    migrate(engine)  # idempotent
    with Session(engine) as session:
        assert session.exec(select(Tenant.name)).all() == ["kept"]
        assert session.exec(select(GpuPool)).all() == []  # the new table exists
    engine.dispose()
