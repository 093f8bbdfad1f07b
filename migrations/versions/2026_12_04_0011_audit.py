"""The audit log of admin and cross-tenant acts (``audit_entries``).

Revision ID: 20261204_0011
Revises: 20261202_0010
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "20261204_0011"
down_revision = "20261202_0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "audit_entries",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("created_ns", sa.BigInteger(), nullable=False),
        sa.Column("actor_key_id", sa.String(64), nullable=True),
        sa.Column("actor_tenant_id", sa.String(64), nullable=True),
        sa.Column("via", sa.String(16), nullable=False),
        sa.Column("action", sa.String(64), nullable=False),
        sa.Column("target_type", sa.String(32), nullable=False),
        sa.Column("target_id", sa.String(256), nullable=False),
        sa.Column("tenant_id", sa.String(64), nullable=True),
        sa.Column("before", sa.JSON(), nullable=True),
        sa.Column("after", sa.JSON(), nullable=True),
    )
    op.create_index("ix_audit_entries_created", "audit_entries", ["created_ns"])
    op.create_index("ix_audit_entries_tenant", "audit_entries", ["tenant_id", "created_ns"])


def downgrade() -> None:
    op.drop_table("audit_entries")
