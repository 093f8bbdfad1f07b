"""Event levels as OpenAI names them: ``warning`` becomes ``warn`` (``info``, ``warn``,
``error``; ``status.add_event`` writes no other).

Revision ID: 20261202_0008
Revises: 20261201_0007
Create Date: 2026-12-02
"""

from __future__ import annotations

from alembic import op

revision = "20261202_0008"
down_revision = "20261201_0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("UPDATE job_events SET level = 'warn' WHERE level = 'warning'")


def downgrade() -> None:
    # Nothing to undo: the code before this revision reads "warn" too (its events filter
    # takes info, warn and error), and a "warn" it may have stored itself (a run's
    # message) cannot be told apart from a rewritten one.
    pass
