"""Evals (``platform/evals.py``): a tenant's item schema and testing criteria, in OpenAI's
shapes.

Revision ID: 20261207_0013
Revises: 20261204_0012
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "20261207_0013"
down_revision = "20261204_0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "evals",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column(
            "tenant_id",
            sa.String(64),
            sa.ForeignKey("tenants.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("name", sa.String(256), nullable=False),
        sa.Column("data_source_config", sa.JSON(), nullable=False),
        sa.Column("testing_criteria", sa.JSON(), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=False),
        sa.Column("created_ns", sa.BigInteger(), nullable=False),
        sa.Column("updated_ns", sa.BigInteger(), nullable=False),
    )
    op.create_index("ix_evals_tenant_id", "evals", ["tenant_id"])


def downgrade() -> None:
    op.drop_index("ix_evals_tenant_id", table_name="evals")
    op.drop_table("evals")
