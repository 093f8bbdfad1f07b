"""Run the Alembic migrations in ``migrations/`` from code (``tunefleet db upgrade``)."""

from __future__ import annotations

import os
from pathlib import Path

from alembic import command
from alembic.config import Config


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
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    command.downgrade(alembic_config(url), revision)
