"""Eval runs and their output items (``workers/_evals.py``), in OpenAI's shapes.

Revision ID: 20261207_0014
Revises: 20261207_0013
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "20261207_0014"
down_revision = "20261207_0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "eval_runs",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column(
            "eval_id", sa.String(64), sa.ForeignKey("evals.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column(
            "tenant_id",
            sa.String(64),
            sa.ForeignKey("tenants.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("name", sa.String(256), nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("base_model", sa.String(256), nullable=False),
        sa.Column("adapter_id", sa.String(64), nullable=False),
        sa.Column("data_source", sa.JSON(), nullable=False),
        sa.Column("items", sa.JSON(), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=False),
        sa.Column("result_counts", sa.JSON(), nullable=False),
        sa.Column("per_testing_criteria_results", sa.JSON(), nullable=False),
        sa.Column("per_model_usage", sa.JSON(), nullable=False),
        sa.Column("error", sa.JSON(), nullable=True),
        sa.Column("created_ns", sa.BigInteger(), nullable=False),
        sa.Column("updated_ns", sa.BigInteger(), nullable=False),
    )
    op.create_index("ix_eval_runs_eval_id", "eval_runs", ["eval_id"])
    op.create_index("ix_eval_runs_tenant_id", "eval_runs", ["tenant_id"])
    op.create_index("ix_eval_runs_status", "eval_runs", ["status"])
    op.create_table(
        "eval_output_items",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column(
            "run_id",
            sa.String(64),
            sa.ForeignKey("eval_runs.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("item_index", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("datasource_item", sa.JSON(), nullable=False),
        sa.Column("sample", sa.JSON(), nullable=True),
        sa.Column("results", sa.JSON(), nullable=False),
        sa.Column("created_ns", sa.BigInteger(), nullable=False),
    )
    op.create_index(
        "uq_eval_output_items_run_item", "eval_output_items", ["run_id", "item_index"], unique=True
    )


def downgrade() -> None:
    op.drop_index("uq_eval_output_items_run_item", table_name="eval_output_items")
    op.drop_table("eval_output_items")
    op.drop_index("ix_eval_runs_status", table_name="eval_runs")
    op.drop_index("ix_eval_runs_tenant_id", table_name="eval_runs")
    op.drop_index("ix_eval_runs_eval_id", table_name="eval_runs")
    op.drop_table("eval_runs")
