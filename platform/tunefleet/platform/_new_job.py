"""Storing a new job: its row and its first event, both or neither, in one place for both
databases. The only hand-written SQL of job creation, the API's hottest write
(``bench/api_load.py``: 300 creations/s on PostgreSQL is the bar): the ORM's unit of work
and a check-then-insert cost more round trips than the bar allows.

One conditional insert stores the job only where its files are usable (the tenant's,
purpose ``fine-tune``, processed, data a supervised job trains on) and the tenant has
fewer than ``waiting_cap`` jobs waiting: no separate check to race with a file's
deletion, and no round trip for it. It returns the stored row, so the API answers with
what the database holds.

Atomic, and the cap exact under concurrent creates, on both databases:
- PostgreSQL: the job's insert is a CTE, the event's insert a second CTE reading the
  first, the outer SELECT returns the job. READ COMMITTED takes its snapshot per
  statement, so concurrent creates of one tenant would each count only the jobs committed
  before they began, and pass the cap by the number in flight. So the statement runs in a
  short transaction after a statement that locks the tenant's row: one tenant's creates
  follow each other, each counting every job created before it; other tenants' creates
  do not wait (``tests/platform/test_new_job.py``, 32 concurrent creates at the cap).
- SQLite: the same job insert, then the event's, in the session's transaction. SQLite
  runs one write transaction at a time, so the count is exact there already.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, TypedDict

from sqlalchemy import Executable, Row, and_, bindparam, exists, func, insert, select
from sqlalchemy.orm import Session

from tunefleet.platform.db import File, Job, JobEvent, Tenant
from tunefleet.platform.status import JobStatus

# Jobs that wait to run, which a tenant's ``max_waiting_jobs`` caps.
WAITING = (JobStatus.VALIDATING_FILES.value, JobStatus.QUEUED.value)

# A job's columns under their attribute names (``metadata_``: ``metadata`` is reserved on
# declarative classes). Lists select these rather than loading ORM objects, which cost more
# than the query; ``jobs.job_view`` reads such a row or a ``Job``.
JOB_COLUMNS = tuple(getattr(Job, attr.key) for attr in Job.__mapper__.column_attrs)
# (column name, attribute name) for each of them: what the insert returns, labelled alike.
_RETURNED = tuple((attr.columns[0].name, attr.key) for attr in Job.__mapper__.column_attrs)


class NewJob(TypedDict):
    """The columns a new job's row is written with (the others take their defaults)."""

    id: str
    tenant_id: str
    status: str
    model: str
    training_file: str
    validation_file: str | None
    fine_tuned_model: str | None
    spec: dict[str, Any]
    request: dict[str, Any]
    metadata: dict[str, Any]
    priority: int
    attempt: int
    idempotency_key: str | None
    created_at: int
    created_ns: int
    updated_at: int
    result_files: list[Any]
    plan: dict[str, Any] | None


class FirstEvent(TypedDict):
    """A new job's first event ("Created fine-tuning job: ...")."""

    id: str
    job_id: str
    created_at: int
    level: str
    type: str
    message: str
    data: dict[str, Any] | None


_JOB_KEYS = tuple(NewJob.__annotations__)
_EVENT_KEYS = tuple(FirstEvent.__annotations__)


def insert_job(
    session: Session,
    job: NewJob,
    event: FirstEvent,
    *,
    files: dict[str, str],
    preference: bool = False,
    waiting_cap: int,
) -> Row[Any] | None:
    """Store ``job`` and ``event`` where each file of ``files`` (parameter name, id) is
    usable (the tenant's, for fine-tuning, processed, of preference pairs for a
    ``preference`` (DPO) job and of anything else otherwise) and the tenant
    has fewer than ``waiting_cap`` jobs waiting. The stored job's row (``JOB_COLUMNS``), or
    None when nothing was stored. A unique-key clash (Idempotency-Key) raises
    IntegrityError."""
    conn = session.connection()
    postgres = conn.dialect.name == "postgresql"
    params: dict[str, Any] = {f"job_{k}": v for k, v in job.items()}
    params.update({f"event_{k}": v for k, v in event.items()})
    params.update({f"file_{param}": file_id for param, file_id in files.items()})
    params["waiting_cap"] = waiting_cap
    statement = _statement(postgres, tuple(files), preference)
    lock = {"tenant": job["tenant_id"]}
    if postgres and conn.get_execution_options().get("isolation_level") == "AUTOCOMMIT":
        # the API's sessions (db.single_statement_sessions) begin no transaction: this
        # one is spelled out
        conn.exec_driver_sql("BEGIN")
        try:
            conn.execute(_LOCK_TENANT, lock)
            row = conn.execute(statement, params).first()
        except BaseException:
            conn.exec_driver_sql("ROLLBACK")
            raise
        conn.exec_driver_sql("COMMIT")
        return row
    if postgres:
        conn.execute(_LOCK_TENANT, lock)
        return conn.execute(statement, params).first()
    row = conn.execute(statement, params).first()
    if row is not None:
        conn.execute(_event_insert(), params)
    return row


# Orders one tenant's creates on PostgreSQL (see the module's docstring).
_LOCK_TENANT = select(Tenant.id).where(Tenant.id == bindparam("tenant")).with_for_update()


@lru_cache(maxsize=8)
def _statement(postgres: bool, files: tuple[str, ...], preference: bool) -> Executable:
    """The job's conditional insert returning its row, with the event's insert on
    PostgreSQL. Built once per shape: building it per request cost more than running it.
    Values are bound as ``job_<column>``, ``event_<column>`` and ``file_<param>``."""
    jobs, file_cols = Job.__table__.c, File.__table__.c
    row = select(*(bindparam(f"job_{k}", type_=jobs[k].type).label(k) for k in _JOB_KEYS))
    waiting = (
        select(jobs.id)
        .where(jobs.tenant_id == bindparam("job_tenant_id"), jobs.status.in_(WAITING))
        .limit(bindparam("waiting_cap"))
        .subquery()
    )
    row = row.where(
        select(func.count()).select_from(waiting).scalar_subquery() < bindparam("waiting_cap")
    )
    for param in files:
        row = row.where(
            exists().where(
                and_(
                    file_cols.id == bindparam(f"file_{param}"),
                    file_cols.tenant_id == bindparam("job_tenant_id"),
                    file_cols.purpose == "fine-tune",
                    file_cols.status == "processed",
                    (file_cols.format == "preference")
                    if preference
                    else (func.coalesce(file_cols.format, "") != "preference"),
                )
            )
        )
    new_job = insert(Job).from_select(list(_JOB_KEYS), row)
    if not postgres:
        return new_job.returning(*(jobs[name].label(key) for name, key in _RETURNED))
    made = new_job.returning(*jobs).cte("new_job")
    event_row = select(
        *(
            made.c.id.label(k)
            if k == "job_id"
            else bindparam(f"event_{k}", type_=JobEvent.__table__.c[k].type).label(k)
            for k in _EVENT_KEYS
        )
    ).select_from(made)
    first_event = insert(JobEvent).from_select(list(_EVENT_KEYS), event_row).cte("first_event")
    return select(*(made.c[name].label(key) for name, key in _RETURNED)).add_cte(first_event)


@lru_cache(maxsize=1)
def _event_insert() -> Executable:
    """SQLite's second statement: the first event, bound as ``event_<column>``."""
    return insert(JobEvent).values({k: bindparam(f"event_{k}") for k in _EVENT_KEYS})
