"""Migrations on SQLite and PostgreSQL: upgrade an empty database, downgrade and upgrade
the newest revision, and no drift between the models and the migrations."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, inspect, text

from tunefleet.platform.db import Base
from tunefleet.platform.db.migrate import (
    alembic_config,
    downgrade,
    upgrade,
    upgrade_unless_newer,
)


def _head(url: str) -> str:
    head = ScriptDirectory.from_config(alembic_config(url)).get_current_head()
    assert head is not None
    return head


def _current(url: str) -> str | None:
    engine = create_engine(url)
    with engine.connect() as conn:
        rev = MigrationContext.configure(conn).get_current_revision()
    engine.dispose()
    return rev


def test_upgrade_empty_database_creates_every_table(db_url: str) -> None:
    upgrade(db_url)
    engine = create_engine(db_url)
    tables = set(inspect(engine).get_table_names())
    engine.dispose()
    assert set(Base.metadata.tables) <= tables
    assert _current(db_url) == _head(db_url)


def test_newest_revision_downgrades_and_upgrades(db_url: str) -> None:
    upgrade(db_url)
    script = ScriptDirectory.from_config(alembic_config(db_url))
    head = script.get_revision(_head(db_url))
    assert head is not None
    downgrade(db_url, head.down_revision or "base")  # type: ignore[arg-type]
    assert _current(db_url) == head.down_revision
    upgrade(db_url)
    assert _current(db_url) == head.revision


def test_models_and_migrations_agree(db_url: str) -> None:
    upgrade(db_url)
    engine = create_engine(db_url)
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True})
        diff = compare_metadata(ctx, Base.metadata)
    engine.dispose()
    assert diff == [], f"models and migrations differ: {diff}"


def test_processes_starting_together_migrate_one_at_a_time(db_url: str) -> None:
    """The Helm hook Job and two controllers upgrading an empty database at once: one
    migrates and the others find it current (a PostgreSQL advisory lock; for a SQLite
    file, a lock file beside it)."""
    import subprocess
    import sys

    code = (
        "import sys; from tunefleet.platform.db.migrate import upgrade_unless_newer; "
        "print(upgrade_unless_newer(sys.argv[1]))"
    )
    processes = [
        subprocess.Popen([sys.executable, "-c", code, db_url], stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    results = [p.communicate(timeout=120)[0].strip() for p in processes]
    assert [p.returncode for p in processes] == [0, 0, 0]
    assert results == ["None", "None", "None"]
    assert _current(db_url) == _head(db_url)


def test_a_database_a_newer_release_migrated_is_used_with_a_warning(db_url: str) -> None:
    upgrade(db_url)
    engine = create_engine(db_url)
    with engine.begin() as conn:  # as after a rollback of the release, not of the schema
        conn.execute(text("UPDATE alembic_version SET version_num = '2099_01_01_0099'"))
    engine.dispose()
    warning = upgrade_unless_newer(db_url)
    assert warning is not None and "2099_01_01_0099" in warning
    assert "tunefleet db downgrade" in warning


def test_event_levels_become_openais(db_url: str) -> None:
    """20261202_0008: events stored with level "warning" read "warn", as OpenAI names it."""
    upgrade(db_url, "20261201_0007")
    engine = create_engine(db_url)
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO tenants (id, name, created_at, max_concurrent_jobs, max_gpus) "
                "VALUES ('t', 't', 0, 1, 1)"
            )
        )
        conn.execute(
            text(
                "INSERT INTO jobs (id, tenant_id, status, model, training_file, spec, request, "
                "metadata, result_files, priority, attempt, created_at, updated_at) VALUES "
                "('j', 't', 'running', 'm', 'f', '{}', '{}', '{}', '[]', 0, 0, 0, 0)"
            )
        )
        for i, level in enumerate(["info", "warning", "error", "warning"]):
            conn.execute(
                text(
                    "INSERT INTO job_events (id, job_id, created_at, level, type, message) "
                    f"VALUES ('e{i}', 'j', 0, '{level}', 'message', 'm')"
                )
            )
    upgrade(db_url)
    with engine.connect() as conn:
        levels = conn.execute(text("SELECT level FROM job_events ORDER BY id")).scalars()
        assert list(levels) == ["info", "warn", "error", "warn"]
    engine.dispose()
