"""Alembic environment. The URL comes from the Alembic config (set by ``tunefleet db``
and the tests) or else from TuneFleet's settings."""

from __future__ import annotations

from alembic import context
from sqlalchemy import pool, text

from tunefleet.platform.db import Base, get_engine
from tunefleet.platform.settings import get_settings

config = context.config
target_metadata = Base.metadata
LOCK_KEY = 0x7475_6E65_666C_6565  # "tunefleet", a PostgreSQL advisory lock of its own


def _url() -> str:
    return config.get_main_option("sqlalchemy.url") or get_settings().resolved_database_url


def run_migrations_offline() -> None:
    context.configure(
        url=_url(), target_metadata=target_metadata, literal_binds=True, render_as_batch=True
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    url = _url()
    engine = get_engine(url) if url.startswith("sqlite") else None
    if engine is None:
        from sqlalchemy import create_engine

        engine = create_engine(url, poolclass=pool.NullPool)
    with engine.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=target_metadata,
            render_as_batch=connection.dialect.name == "sqlite",
            compare_type=True,
        )
        with context.begin_transaction():
            if connection.dialect.name == "postgresql":
                # one migrator at a time (a Helm hook Job and controllers starting at once):
                # the others wait, then find the schema current
                connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": LOCK_KEY})
            context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
