"""Run the Alembic migrations in ``migrations/`` from code (``tunefleet db upgrade``)."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.util import CommandError


def migrations_dir() -> Path:
    """``TUNEFLEET_MIGRATIONS_DIR``, else the repository's ``migrations/`` (editable
    install), else the copy packed into the wheel."""
    if env := os.environ.get("TUNEFLEET_MIGRATIONS_DIR"):
        return Path(env)
    here = Path(__file__).resolve()
    for candidate in (here.parents[4] / "migrations", here.parents[2] / "_migrations"):
        if (candidate / "env.py").is_file():
            return candidate
    raise FileNotFoundError("Alembic migrations not found; set TUNEFLEET_MIGRATIONS_DIR")


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """Migrate to ``revision``, one process at a time: PostgreSQL through an advisory lock
    (``migrations/env.py``), a SQLite file through a lock file beside it."""
    with _sqlite_lock(url):
        command.upgrade(alembic_config(url), revision)


@contextlib.contextmanager
def _sqlite_lock(url: str) -> Iterator[None]:
    path = url.removeprefix("sqlite:///") if url.startswith("sqlite:///") else ""
    if not path or path.startswith(":memory:"):
        yield
        return
    lock = Path(path).with_name(Path(path).name + ".migrate-lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # released when the file closes
        yield


def upgrade_unless_newer(url: str) -> str | None:
    """Upgrade to this release's head, as a process starting does; a database already
    migrated by a newer release (a rollback) is left alone. Returns a warning then."""
    try:
        upgrade(url)
    except CommandError as exc:
        if "Can't locate revision" not in str(exc):
            raise
        return (
            f"the database is at a revision this release does not know ({exc}); a newer "
            "release migrated it. Running against it: roll back the schema with "
            "`tunefleet db downgrade` from the newer release if this release cannot"
        )
    return None


def downgrade(url: str, revision: str) -> None:
    command.downgrade(alembic_config(url), revision)
