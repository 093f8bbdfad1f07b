"""What the dashboard's pages read, scoped to the viewer: a tenant's key sees its own
tenant's objects, an admin key every tenant's. Built on the platform's own pieces
(``jobs.get_job``, ``jobs.list_events``, ``JOB_COLUMNS``, ``paging.ordered_after``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from sqlalchemy import Row, Select, func, or_, select
from sqlalchemy.orm import Session

from tunefleet.platform.artifacts import Store
from tunefleet.platform.db import Checkpoint, File, Job, JobEvent, Tenant
from tunefleet.platform.db.paging import ordered_after
from tunefleet.platform.errors import InvalidRequest, NotFound
from tunefleet.platform.jobs import JOB_COLUMNS, WAITING, JobCreateRequest, get_job
from tunefleet.platform.status import JobStatus
from tunefleet.platform.tenants import Principal

PAGE = 25
HEAD_LINES = 20
HEAD_BYTES = 64 * 1024
HEAD_LINE_CHARS = 2000


def _scoped(query: Select[Any], principal: Principal, tenant_id: str | None = None) -> Any:
    """``query`` of jobs limited to what ``principal`` may see (and, for an admin, to
    ``tenant_id`` when one is asked for)."""
    if not principal.is_admin:
        return query.where(Job.tenant_id == principal.tenant_id)
    return query.where(Job.tenant_id == tenant_id) if tenant_id else query


def visible_job(session: Session, principal: Principal, job_id: str) -> Job:
    """The job, when the viewer may see it; 404 otherwise (as the REST API answers)."""
    if not principal.is_admin:
        return get_job(session, principal, job_id)
    job = session.get(Job, job_id)
    if job is None:
        raise NotFound(f"no fine-tuning job with id {job_id!r}", param="fine_tuning_job_id")
    return job


def tenant_names(session: Session, principal: Principal) -> dict[str, str]:
    """Tenant id -> name: every tenant for an admin, the viewer's own otherwise."""
    if not principal.is_admin:
        return {principal.tenant_id: principal.tenant_name}
    rows = session.execute(select(Tenant.id, Tenant.name).order_by(Tenant.name))
    return {tenant_id: name for tenant_id, name in rows}


def tenant_name(session: Session, tenant_id: str) -> str:
    tenant = session.get(Tenant, tenant_id)
    return tenant.name if tenant is not None else tenant_id


# -- the jobs list --------------------------------------------------------------------


@dataclass(frozen=True)
class JobFilters:
    status: str = ""
    model: str = ""
    tenant: str = ""  # a tenant id (admins)
    metadata: str = ""  # "key=value"
    after: str = ""  # a job id: the page after it

    def metadata_pair(self) -> tuple[str, str] | None:
        if not self.metadata.strip():
            return None
        key, sep, value = self.metadata.partition("=")
        if not sep or not key.strip():
            raise InvalidRequest(
                f"metadata filter {self.metadata[:80]!r} is not key=value; write e.g. team=search",
                param="metadata",
            )
        return key.strip(), value.strip()

    def query(self, **changes: str) -> dict[str, str]:
        """These filters as query parameters (empty ones left out), with ``changes``."""
        values = {**self.__dict__, **changes}
        return {k: v for k, v in values.items() if v}


def list_jobs(
    session: Session, principal: Principal, filters: JobFilters, limit: int = PAGE
) -> tuple[list[Row[Any]], bool]:
    """A page of the jobs the viewer sees, newest first; returns (rows, has_more). Every
    filter is applied in the database: a metadata pair by its JSON path (SQLite's
    ``json_extract``, PostgreSQL's ``->>``), so a page reads one page of rows however
    many jobs there are (``bench/dashboard_load.py``)."""
    if filters.status and filters.status not in set(JobStatus):
        raise InvalidRequest(f"status {filters.status!r} is not a job status", param="status")
    wanted = filters.metadata_pair()
    query = _scoped(select(*JOB_COLUMNS), principal, filters.tenant)
    if filters.status:
        query = query.where(Job.status == filters.status)
    if filters.model.strip():
        query = query.where(Job.model == filters.model.strip())
    if wanted is not None:
        query = query.where(Job.metadata_[wanted[0]].as_string() == wanted[1])
    anchor = None
    if filters.after:
        found = visible_job(session, principal, filters.after)
        anchor = (found.created_ns, found.id)
    ordered = ordered_after(query, Job.created_ns, Job.id, anchor)
    rows = list(session.execute(ordered.limit(limit + 1)))
    return rows[:limit], len(rows) > limit


# -- the overview ---------------------------------------------------------------------


@dataclass(frozen=True)
class Waiting:
    job: Row[Any]
    position: int | None
    reason: str


@dataclass(frozen=True)
class Running:
    job: Row[Any]
    latest: dict[str, Any] | None  # the newest metrics event's data


def waiting_jobs(session: Session, principal: Principal, limit: int = PAGE) -> list[Waiting]:
    """Jobs waiting to run, in the scheduler's order where it has told them their place
    (the controller's "Waiting in queue" events carry ``queue_position`` and ``reason``)."""
    query = _scoped(select(*JOB_COLUMNS).where(Job.status.in_(WAITING)), principal)
    out = []
    for job in session.execute(query.order_by(Job.created_ns, Job.id).limit(limit)):
        if job.status == JobStatus.VALIDATING_FILES:
            out.append(Waiting(job, None, "its files are being counted"))
            continue
        told = next(
            (
                data
                for data in session.scalars(
                    select(JobEvent.data)
                    .where(JobEvent.job_id == job.id, JobEvent.type == "message")
                    .order_by(JobEvent.seq.desc())
                    .limit(5)
                )
                if data and "queue_position" in data
            ),
            None,
        )
        if told is None:
            out.append(Waiting(job, None, "not yet placed by the scheduler"))
        else:
            out.append(Waiting(job, int(told["queue_position"]), str(told.get("reason", ""))))
    return sorted(out, key=lambda w: (w.position is None, w.position or 0))


def latest_metrics(session: Session, job_id: str) -> dict[str, Any] | None:
    data: dict[str, Any] | None = session.scalar(
        select(JobEvent.data)
        .where(JobEvent.job_id == job_id, JobEvent.type == "metrics")
        .order_by(JobEvent.seq.desc())
        .limit(1)
    )
    return data


def running_jobs(session: Session, principal: Principal, limit: int = PAGE) -> list[Running]:
    query = _scoped(select(*JOB_COLUMNS).where(Job.status == JobStatus.RUNNING), principal)
    rows = session.execute(query.order_by(Job.created_ns, Job.id).limit(limit)).all()
    return [Running(job, latest_metrics(session, job.id)) for job in rows]


def recent_failures(session: Session, principal: Principal, limit: int = 10) -> list[Row[Any]]:
    query = _scoped(select(*JOB_COLUMNS).where(Job.status == JobStatus.FAILED), principal)
    return list(session.execute(query.order_by(Job.finished_at.desc(), Job.id).limit(limit)))


# -- one job --------------------------------------------------------------------------


@dataclass(frozen=True)
class Curves:
    train: list[tuple[float, float]]
    valid: list[tuple[float, float]]
    latest: dict[str, Any] | None


# Reports a job page reads at most: a chart draws 500 points a series (charts.MAX_POINTS),
# and a job of 50,000 steps would otherwise send 50,000 rows to be thinned here.
MAX_REPORTS = 2000


def loss_curves(session: Session, job_id: str) -> Curves:
    """Training and validation loss by step from the job's metrics events; a step reported
    again (a run resumed from an older checkpoint) keeps its newest value. Of more than
    ``MAX_REPORTS`` reports the database sends every k-th (the first and the last kept),
    so that a long job's page reads about ``MAX_REPORTS`` rows, not one per step."""
    train: dict[float, float] = {}
    valid: dict[float, float] = {}
    numbered = (
        select(
            JobEvent.seq,
            JobEvent.data,
            func.row_number().over(order_by=JobEvent.seq).label("n"),
            func.count().over().label("total"),
        )
        .where(JobEvent.job_id == job_id, JobEvent.type == "metrics")
        .subquery()
    )
    stride = (numbered.c.total + MAX_REPORTS - 1) // MAX_REPORTS
    # the three numbers read out of each kept event's JSON by the database, not the whole
    # document decoded here
    data = numbered.c.data
    rows = session.execute(
        select(
            data["step"].as_float(), data["train_loss"].as_float(), data["valid_loss"].as_float()
        )
        .where(
            or_(
                numbered.c.total <= MAX_REPORTS,
                (numbered.c.n - 1) % stride == 0,
                numbered.c.n == numbered.c.total,
            )
        )
        .order_by(numbered.c.seq)
    )
    for step, train_loss, valid_loss in rows:
        if step is None:
            continue
        if train_loss is not None:
            train[step] = train_loss
        if valid_loss is not None:
            valid[step] = valid_loss
    return Curves(sorted(train.items()), sorted(valid.items()), latest_metrics(session, job_id))


def asked_and_reasons(session: Session, job: Job) -> tuple[dict[str, Any], dict[str, str]]:
    """The hyperparameters as the request asked for them ("auto" or a value) and why each
    "auto" settled as it did (the job's first event, ``data.auto``)."""
    try:
        asked = JobCreateRequest.model_validate(job.request).asked_hyperparameters()
    except ValidationError:  # a request stored by an older version
        asked = {}
    first = session.scalar(
        select(JobEvent.data).where(JobEvent.job_id == job.id).order_by(JobEvent.seq).limit(1)
    )
    reasons = (first or {}).get("auto") or {}
    return asked, {str(k): str(v) for k, v in reasons.items()}


def checkpoints(session: Session, store: Store, job_id: str, limit: int = 20) -> list[Checkpoint]:
    """The job's checkpoints still in the store (Ray Train keeps the newest few), newest
    first."""
    rows = session.scalars(
        select(Checkpoint)
        .where(Checkpoint.job_id == job_id)
        .order_by(Checkpoint.step.desc(), Checkpoint.id.desc())
        .limit(limit)
    )
    return [c for c in rows if store.exists(c.path)]


# -- files ----------------------------------------------------------------------------


def list_files(session: Session, principal: Principal, limit: int = 200) -> list[File]:
    query = select(File).order_by(File.created_at.desc(), File.id.desc()).limit(limit)
    if not principal.is_admin:
        query = query.where(File.tenant_id == principal.tenant_id)
    return list(session.scalars(query))


def visible_file(session: Session, principal: Principal, file_id: str) -> File:
    f = session.get(File, file_id)
    if f is None or (not principal.is_admin and f.tenant_id != principal.tenant_id):
        raise NotFound(f"no file with id {file_id!r}", param="file_id")
    return f


def jobs_using(session: Session, principal: Principal, file_id: str) -> list[Row[Any]]:
    used = or_(Job.training_file == file_id, Job.validation_file == file_id)
    query = _scoped(select(*JOB_COLUMNS).where(used), principal)
    return list(session.execute(query.order_by(Job.created_ns.desc()).limit(20)))


def file_head(store: Store, key: str) -> tuple[list[str], bool]:
    """The first ``HEAD_LINES`` lines of a stored file (each cut at ``HEAD_LINE_CHARS``,
    at most ``HEAD_BYTES`` read), and whether there is more."""
    chunks = store.read_chunks(key, chunk_size=HEAD_BYTES)
    try:
        head = next(chunks, b"")
        more = len(head) >= HEAD_BYTES or next(chunks, b"") != b""
    finally:
        chunks.close()  # type: ignore[attr-defined]
    lines = head.decode("utf-8", errors="replace").splitlines()
    if len(lines) > HEAD_LINES:
        lines, more = lines[:HEAD_LINES], True
    return [line[:HEAD_LINE_CHARS] for line in lines], more
