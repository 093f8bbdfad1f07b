"""Dashboard sessions signed out before their cookie expires (``ui_ended_sessions``).

Revision ID: 20261202_0009
Revises: 20261202_0008
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "20261202_0009"
down_revision = "20261202_0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ui_ended_sessions",
        sa.Column("token_hash", sa.String(64), primary_key=True),
        sa.Column("expires_at", sa.BigInteger(), nullable=False),
    )
    op.create_index("ix_ui_ended_sessions_expires_at", "ui_ended_sessions", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_ui_ended_sessions_expires_at", "ui_ended_sessions")
    op.drop_table("ui_ended_sessions")
