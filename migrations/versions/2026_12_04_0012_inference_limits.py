"""Per-tenant inference limits (tenants' overrides, ``inference_buckets`` and
``inference_leases``), and adapter shares by tenant name (a share no longer needs the
tenant to exist, so sharing does not reveal which tenant names do).

On PostgreSQL the limits' two tables are UNLOGGED (``platform/inference_limits.py``).

Revision ID: 20261204_0012
Revises: 20261204_0011
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "20261204_0012"
down_revision = "20261204_0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("inference_requests_per_s", sa.Float(), nullable=True))
        batch.add_column(sa.Column("inference_concurrent_requests", sa.Integer(), nullable=True))
    # no WAL flush per admission (platform/inference_limits.py)
    unlogged = ["UNLOGGED"] if op.get_bind().dialect.name == "postgresql" else []
    op.create_table(
        "inference_buckets",
        sa.Column(
            "tenant_id",
            sa.String(64),
            sa.ForeignKey("tenants.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("tat", sa.Float(), nullable=False),
        prefixes=unlogged,
    )
    op.create_table(
        "inference_leases",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column(
            "tenant_id",
            sa.String(64),
            sa.ForeignKey("tenants.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("expires_at", sa.Float(), nullable=False),
        prefixes=unlogged,
    )
    op.create_index("ix_inference_leases_tenant", "inference_leases", ["tenant_id", "expires_at"])
    _shares_keyed_by("tenant_name")


def downgrade() -> None:
    _shares_keyed_by("tenant_id")
    op.drop_table("inference_leases")
    op.drop_table("inference_buckets")
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("inference_concurrent_requests")
        batch.drop_column("inference_requests_per_s")


def _shares_keyed_by(column: str) -> None:
    """Rebuild ``adapter_shares`` keyed by the tenant's name or id, converting its rows
    (going back to ids, a share naming no tenant is dropped)."""
    tenant = (
        sa.Column("tenant_name", sa.String(64), primary_key=True)
        if column == "tenant_name"
        else sa.Column(
            "tenant_id",
            sa.String(64),
            sa.ForeignKey("tenants.id", ondelete="CASCADE"),
            primary_key=True,
        )
    )
    op.create_table(
        "adapter_shares_new",
        sa.Column(
            "adapter_id",
            sa.String(64),
            sa.ForeignKey("adapters.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        tenant,
        sa.Column("created_at", sa.BigInteger(), nullable=False),
    )
    if column == "tenant_name":
        op.execute(
            "INSERT INTO adapter_shares_new (adapter_id, tenant_name, created_at) "
            "SELECT s.adapter_id, t.name, s.created_at FROM adapter_shares s "
            "JOIN tenants t ON t.id = s.tenant_id"
        )
    else:
        op.execute(
            "INSERT INTO adapter_shares_new (adapter_id, tenant_id, created_at) "
            "SELECT s.adapter_id, t.id, s.created_at FROM adapter_shares s "
            "JOIN tenants t ON t.name = s.tenant_name"
        )
    op.drop_table("adapter_shares")
    op.rename_table("adapter_shares_new", "adapter_shares")
    op.create_index(f"ix_adapter_shares_{column}", "adapter_shares", [column])
