"""Which run's records, up to which number, are in the database: ``progress.apply``
writes each record a run reports through its channel once, whatever a controller
fail-over repeats.

Revision ID: 20261201_0007
Revises: 20261201_0006
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "20261201_0007"
down_revision = "20261201_0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("reported", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("reported")
