"""A cap per tenant on jobs waiting to run (``validating_files`` or ``queued``), and the
index that counts them.

Revision ID: 20261201_0006
Revises: 20261129_0005
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "20261201_0006"
down_revision = "20261129_0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(
            sa.Column(
                "max_waiting_jobs", sa.Integer(), nullable=False, server_default=sa.text("100")
            )
        )
    op.create_index("ix_jobs_tenant_status", "jobs", ["tenant_id", "status"])


def downgrade() -> None:
    op.drop_index("ix_jobs_tenant_status", "jobs")
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("max_waiting_jobs")
