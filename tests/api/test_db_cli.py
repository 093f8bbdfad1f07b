"""`tunefleet db upgrade|downgrade` as an operator runs them: a separate process that reads
its database from ``TUNEFLEET_DATABASE_URL`` (or ``TUNEFLEET_DATA_DIR``), on SQLite and
PostgreSQL."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, inspect, select
from sqlalchemy.orm import Session

from tunefleet.platform.db import Base, Tenant
from tunefleet.platform.db.migrate import alembic_config, upgrade
from tunefleet.platform.tenants import create_tenant


def tunefleet(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``tunefleet ARGS`` in a fresh interpreter whose only TuneFleet settings are
    ``env`` (none inherited from this process, nor a Ray address)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "TUNEFLEET_"))}
    out = subprocess.run(
        [sys.executable, "-m", "tunefleet.cli.main", *args],
        cwd=cwd,  # not the repository: nothing may depend on where it is run from
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout}\n{out.stderr}"
    return out


def head(url: str) -> str:
    rev = ScriptDirectory.from_config(alembic_config(url)).get_current_head()
    assert rev is not None
    return rev


def schema(url: str) -> tuple[set[str], str | None]:
    """The database's tables and its Alembic revision (None: unversioned)."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return set(inspect(conn).get_table_names()), MigrationContext.configure(
                conn
            ).get_current_revision()
    finally:
        engine.dispose()


def tenant_names(url: str) -> list[str]:
    engine = create_engine(url)
    try:
        with Session(engine) as s:
            return list(s.scalars(select(Tenant.name)))
    finally:
        engine.dispose()


def test_db_upgrade_creates_the_schema_at_head_and_is_idempotent(
    db_url: str, tmp_path: Path
) -> None:
    env = {"TUNEFLEET_DATABASE_URL": db_url, "TUNEFLEET_DATA_DIR": str(tmp_path / "data")}
    assert schema(db_url) == (set(), None)

    out = tunefleet(["db", "upgrade"], tmp_path, **env)

    assert "database at revision head" in out.stdout
    tables, revision = schema(db_url)
    assert set(Base.metadata.tables) <= tables
    assert revision == head(db_url)
    # data written after the first run survives the second, which changes nothing
    engine = create_engine(db_url)
    with Session(engine) as s:
        create_tenant(s, "kept")
        s.commit()
    engine.dispose()

    tunefleet(["db", "upgrade"], tmp_path, **env)

    assert schema(db_url) == (tables, revision)
    assert tenant_names(db_url) == ["kept"]


def test_db_downgrade_base_removes_the_tables(db_url: str, tmp_path: Path) -> None:
    upgrade(db_url)
    assert set(Base.metadata.tables) <= schema(db_url)[0]

    tunefleet(["db", "downgrade", "base"], tmp_path, TUNEFLEET_DATABASE_URL=db_url)

    # Alembic keeps its (now empty) version table
    assert schema(db_url) == ({"alembic_version"}, None)


def test_db_upgrade_defaults_to_a_sqlite_file_in_the_data_dir(tmp_path: Path) -> None:
    data_dir = tmp_path / "not-yet" / "data"

    tunefleet(["db", "upgrade"], tmp_path, TUNEFLEET_DATA_DIR=str(data_dir))

    url = f"sqlite:///{data_dir / 'tunefleet.db'}"
    tables, revision = schema(url)
    assert set(Base.metadata.tables) <= tables
    assert revision == head(url)
