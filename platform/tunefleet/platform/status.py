"""The job state machine: states, the transition table, and the one function that writes status.

``transition`` is a compare-and-set: it updates the row only if the job is still in one of
the expected states, and writes an event row in the same transaction (the caller's
session; the caller commits). Two writers racing on one job cannot both win. A move to an
end (succeeded, failed, cancelled) also puts its webhook deliveries in the outbox, in that
transaction (``webhooks.enqueue``).
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from tunefleet.platform import audit
from tunefleet.platform.audit import Actor
from tunefleet.platform.db import Job, JobEvent, now_s
from tunefleet.platform.errors import Conflict
from tunefleet.platform.ids import new_id
from tunefleet.platform.webhooks import enqueue


class JobStatus(StrEnum):
    VALIDATING_FILES = "validating_files"
    QUEUED = "queued"
    RUNNING = "running"
    PAUSED = "paused"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


S = JobStatus
TERMINAL: frozenset[JobStatus] = frozenset({S.SUCCEEDED, S.FAILED, S.CANCELLED})

# from -> the states it may move to. RUNNING -> QUEUED is a retry after a lost run.
TRANSITIONS: dict[JobStatus, frozenset[JobStatus]] = {
    S.VALIDATING_FILES: frozenset({S.QUEUED, S.FAILED, S.CANCELLED}),
    S.QUEUED: frozenset({S.RUNNING, S.PAUSED, S.FAILED, S.CANCELLED}),
    S.RUNNING: frozenset({S.SUCCEEDED, S.FAILED, S.CANCELLED, S.PAUSED, S.QUEUED}),
    S.PAUSED: frozenset({S.QUEUED, S.CANCELLED}),
    S.SUCCEEDED: frozenset(),
    S.FAILED: frozenset(),
    S.CANCELLED: frozenset(),
}


def can_transition(src: JobStatus, dst: JobStatus) -> bool:
    return dst in TRANSITIONS[src]


def sources(dst: JobStatus) -> list[JobStatus]:
    """The states a job may move to ``dst`` from, in the table's order (what a cancel or
    a pause expects the job to be in)."""
    return [src for src, targets in TRANSITIONS.items() if dst in targets]


# Not finished: the job holds (or waits for) a place on the cluster.
ACTIVE: tuple[JobStatus, ...] = tuple(s for s in JobStatus if s not in TERMINAL)


# An event's levels, as OpenAI names them. "warning", which earlier code wrote (migration
# 20261202_0008 rewrote those rows) and a run of it may still report, is stored as "warn".
LEVELS = ("info", "warn", "error")
_LEVEL_ALIASES = {"warning": "warn"}


def add_event(
    session: Session,
    job_id: str,
    message: str,
    *,
    level: str = "info",
    type: str = "message",
    data: dict[str, Any] | None = None,
) -> JobEvent:
    """Append one event to a job's history (in the caller's transaction). ``level`` is
    one of LEVELS (or an alias of one); another is a ValueError."""
    level = _LEVEL_ALIASES.get(level, level)
    if level not in LEVELS:
        raise ValueError(f"event level {level!r} is not one of {', '.join(LEVELS)}")
    event = JobEvent(
        id=new_id("event"),
        job_id=job_id,
        created_at=now_s(),
        level=level,
        type=type,
        message=message,
        data=data,
    )
    session.add(event)
    return event


def transition(
    session: Session,
    job_id: str,
    expected: JobStatus | Iterable[JobStatus],
    to: JobStatus,
    message: str,
    *,
    level: str = "info",
    data: dict[str, Any] | None = None,
    **fields: Any,
) -> None:
    """Move ``job_id`` from one of ``expected`` to ``to``, setting ``fields`` too.

    Raises ``Conflict`` naming the current state when the job is no longer in ``expected``
    (someone else moved it first) and ``ValueError`` for a move the table forbids.
    """
    sources = {expected} if isinstance(expected, JobStatus) else set(expected)
    for src in sources:
        if not can_transition(src, to):
            raise ValueError(f"job transition {src.value} -> {to.value} is not allowed")
    values: dict[str, Any] = {"status": to.value, "updated_at": now_s(), **fields}
    if to in TERMINAL:
        values.setdefault("finished_at", now_s())
    if to is not S.RUNNING:
        # OpenAI's estimated_finish is null whenever the job is not running (paused,
        # cancelled, failed, queued again); the next run's first metrics set it again
        values.setdefault("estimated_finish", None)
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status.in_([s.value for s in sources]))
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:  # type: ignore[attr-defined]
        current = session.get(Job, job_id)
        state = current.status if current is not None else "missing"
        raise Conflict(
            f"job {job_id} is {state}, not {' or '.join(sorted(s.value for s in sources))}; "
            f"it cannot move to {to.value}",
            code="invalid_state",
        )
    add_event(session, job_id, message, level=level, data=data)
    if to in TERMINAL:
        enqueue(session, job_id, to.value)


# What a tenant may ask of its job (the REST routes and the dashboard's buttons): the
# states the job must be in, the state it moves to, and the event that records it ({by}:
# who asked).
REQUESTS: dict[str, tuple[tuple[JobStatus, ...], JobStatus, str]] = {
    "cancel": (tuple(sources(S.CANCELLED)), S.CANCELLED, "Job cancelled by {by}"),
    "pause": (tuple(sources(S.PAUSED)), S.PAUSED, "Job paused by {by}"),
    "resume": ((S.PAUSED,), S.QUEUED, "Job resumed by {by}; queued"),
}


def request_move(session: Session, job_id: str, action: str, actor: Actor | None = None) -> None:
    """Do ``action`` (a key of REQUESTS) on ``job_id`` (a compare-and-set: ``Conflict``
    naming the job's state when it is in none the action starts from). With an ``actor``
    (the REST routes, the dashboard), the job's event names it, and an act on another
    tenant's job (an admin's) goes in the audit log with the status before and after."""
    expected, to, message = REQUESTS[action]
    if actor is None:
        transition(session, job_id, expected, to, message.format(by="request"))
        return
    found = session.execute(select(Job.tenant_id, Job.status).where(Job.id == job_id)).first()
    transition(
        session,
        job_id,
        expected,
        to,
        message.format(by=actor.describe()),
        data={"actor": {"key_id": actor.key_id, "via": actor.via}},
    )
    if found is not None and found.tenant_id != actor.tenant_id:
        audit.record(
            session,
            actor,
            f"job.{action}",
            target_type="job",
            target_id=job_id,
            tenant_id=found.tenant_id,
            before={"status": found.status},
            after={"status": to.value},
        )
