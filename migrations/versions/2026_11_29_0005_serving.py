"""Serving: how each adapter is served (multiplexed or merged, pinned), and sharing an
adapter with other tenants.

Revision ID: 20261129_0005
Revises: 20261129_0004
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "20261129_0005"
down_revision = "20261129_0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("adapters") as batch:
        batch.add_column(
            sa.Column(
                "serving_mode",
                sa.String(16),
                server_default=sa.text("'multiplexed'"),
                nullable=False,
            )
        )
        batch.add_column(
            sa.Column("pinned", sa.Boolean(), server_default=sa.text("false"), nullable=False)
        )
    op.create_table(
        "adapter_shares",
        sa.Column(
            "adapter_id",
            sa.String(64),
            sa.ForeignKey("adapters.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column(
            "tenant_id",
            sa.String(64),
            sa.ForeignKey("tenants.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
    )
    op.create_index("ix_adapter_shares_tenant_id", "adapter_shares", ["tenant_id"])


def downgrade() -> None:
    op.drop_index("ix_adapter_shares_tenant_id", "adapter_shares")
    op.drop_table("adapter_shares")
    with op.batch_alter_table("adapters") as batch:
        batch.drop_column("pinned")
        batch.drop_column("serving_mode")
