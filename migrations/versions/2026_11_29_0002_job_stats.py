"""Jobs keep the token statistics of their files (counted at admission) and a
nanosecond creation time that orders listings and cursors.

Revision ID: 20261129_0002
Revises: 20261129_0001
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "20261129_0002"
down_revision = "20261129_0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("stats", sa.JSON(), nullable=True))
        batch.add_column(
            sa.Column("created_ns", sa.BigInteger(), nullable=False, server_default=sa.text("0"))
        )
        batch.drop_index("ix_jobs_tenant_created")
        batch.create_index("ix_jobs_tenant_created_ns", ["tenant_id", "created_ns"])
    op.execute("UPDATE jobs SET created_ns = created_at * 1000000000")


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_index("ix_jobs_tenant_created_ns")
        batch.create_index("ix_jobs_tenant_created", ["tenant_id", "created_at"])
        batch.drop_column("created_ns")
        batch.drop_column("stats")
