"""Scheduling: the controller lease, and per-job failures, backoff and placement.

Revision ID: 20261129_0004
Revises: 20261129_0003
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "20261129_0004"
down_revision = "20261129_0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "controller_leases",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("holder", sa.String(128), nullable=False),
        sa.Column("term", sa.BigInteger(), nullable=False),
        sa.Column("expires_ms", sa.BigInteger(), nullable=False),
    )
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(
            sa.Column("failures", sa.Integer(), server_default=sa.text("0"), nullable=False)
        )
        batch.add_column(sa.Column("not_before", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("placement", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("placement")
        batch.drop_column("not_before")
        batch.drop_column("failures")
    op.drop_table("controller_leases")
