"""The audit log: every admin act and every act on another tenant's object, with who did
it, on what, and the object's values before and after.

Recorded by the platform calls themselves when they are given an ``Actor`` (the admin
REST routes, the dashboard's forms and the ``tunefleet admin`` CLI all give one), in the
act's own transaction: an act is never stored without its entry. Acts recorded:

- ``tenant.create``, ``tenant.quotas``; ``key.create``, ``key.revoke``;
- ``adapter.serving`` (merged or multiplexed, pinned);
- ``webhook.create``, ``webhook.delete``;
- ``base_model.add`` (with its source), ``base_model.remove``;
- ``job.pause``, ``job.resume``, ``job.cancel`` on another tenant's job (an admin on the
  dashboard). Every pause, resume and cancel, anyone's, also names its actor in the job's
  own event.

Read through ``GET /v1/admin/audit`` and the dashboard's admin page. Entries are never
changed or deleted by TuneFleet, and outlive the tenants they name.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from sqlalchemy import select
from sqlalchemy.orm import Session

from tunefleet.platform.db import AuditEntry
from tunefleet.platform.ids import new_id

if TYPE_CHECKING:
    from tunefleet.platform.tenants import Principal

Via = Literal["api", "dashboard", "cli"]


@dataclass(frozen=True)
class Actor:
    """Who acts: a key (its id and tenant) through the API or the dashboard, or the
    operator's CLI (no key: it works on the database directly)."""

    key_id: str | None
    tenant_id: str | None
    via: Via

    @classmethod
    def of(cls, principal: Principal, via: Via) -> Actor:
        return cls(principal.key_id, principal.tenant_id, via)

    def describe(self) -> str:
        """As a job's event says it: "key key-... via the dashboard"."""
        if self.key_id is None:
            return "the operator's CLI"
        return f"key {self.key_id} via the {'API' if self.via == 'api' else self.via}"


# The operator's `tunefleet admin` commands.
CLI = Actor(None, None, "cli")


def record(
    session: Session,
    actor: Actor,
    action: str,
    *,
    target_type: str,
    target_id: str,
    tenant_id: str | None,
    before: dict[str, Any] | None = None,
    after: dict[str, Any] | None = None,
) -> AuditEntry:
    """Add one entry to the session's transaction."""
    now_ns = time.time_ns()
    entry = AuditEntry(
        id=new_id("audit"),
        created_at=now_ns // 1_000_000_000,
        created_ns=now_ns,
        actor_key_id=actor.key_id,
        actor_tenant_id=actor.tenant_id,
        via=actor.via,
        action=action,
        target_type=target_type,
        target_id=target_id,
        tenant_id=tenant_id,
        before=before,
        after=after,
    )
    session.add(entry)
    session.flush()
    return entry


def entries(
    session: Session,
    *,
    limit: int = 100,
    after: str | None = None,
    tenant_id: str | None = None,
    action: str | None = None,
) -> tuple[list[AuditEntry], bool]:
    """The newest entries first, ``limit`` of them, older than entry ``after`` (a cursor:
    the last id of the previous page), of one tenant's objects or one action if given;
    and whether there are more."""
    query = select(AuditEntry).order_by(AuditEntry.created_ns.desc(), AuditEntry.id.desc())
    if tenant_id is not None:
        query = query.where(AuditEntry.tenant_id == tenant_id)
    if action is not None:
        query = query.where(AuditEntry.action == action)
    if after is not None:
        cursor = session.get(AuditEntry, after)
        if cursor is not None:
            query = query.where(
                (AuditEntry.created_ns < cursor.created_ns)
                | ((AuditEntry.created_ns == cursor.created_ns) & (AuditEntry.id < cursor.id))
            )
    rows = list(session.scalars(query.limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def entry_view(entry: AuditEntry) -> dict[str, Any]:
    return {
        "id": entry.id,
        "object": "audit_entry",
        "created_at": entry.created_at,
        "actor": {
            "key_id": entry.actor_key_id,
            "tenant_id": entry.actor_tenant_id,
            "via": entry.via,
        },
        "action": entry.action,
        "target": {
            "type": entry.target_type,
            "id": entry.target_id,
            "tenant_id": entry.tenant_id,
        },
        "before": entry.before,
        "after": entry.after,
    }
