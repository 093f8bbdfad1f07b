"""``/v1/fine_tuning/jobs``: OpenAI's paths and shapes, scoped to the caller's tenant."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Header, Query, Request
from sqlalchemy import Row, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from tunefleet.api._deps import (
    PrincipalDep,
    RegistryDep,
    SessionDep,
    SettingsDep,
    StatementSessionDep,
    StoreDep,
)
from tunefleet.api._openapi import CheckpointList, EventList, JobList, JobObject, errors, ok
from tunefleet.api._responses import FastJSONResponse
from tunefleet.platform.audit import Actor
from tunefleet.platform.db import Checkpoint, Job
from tunefleet.platform.db.paging import ordered_after
from tunefleet.platform.errors import NotFound, TuneFleetError
from tunefleet.platform.jobs import (
    JOB_COLUMNS,
    JobCreateRequest,
    create_job,
    event_view,
    get_job,
    job_view,
    list_events,
)
from tunefleet.platform.planner import PlanDevice
from tunefleet.platform.serving import checkpoint_model_name
from tunefleet.platform.status import request_move
from tunefleet.platform.tenants import Principal

router = APIRouter(prefix="/v1/fine_tuning/jobs", tags=["fine-tuning"])
# The convention for routes: plain ``def`` (FastAPI runs them in its thread pool), except
# the hot ones measured under load. Here creation, listing, retrieval, events and
# checkpoints are ``async def`` and make their few short database calls on the event loop:
# under 32 concurrent clients (bench/api_load.py) the thread pool cost more in GIL
# hand-offs than these sub-millisecond calls block the loop. They answer with a
# JSONResponse of plain JSON types, skipping jsonable_encoder, and use single-statement
# sessions: in autocommit on PostgreSQL, without BEGIN/COMMIT round trips blocking the
# loop. Cancel, pause and resume are rare: plain ``def``.


@router.post("", responses={**ok(JobObject), **errors(404, 429)})
async def create(
    body: JobCreateRequest,
    session: StatementSessionDep,
    principal: PrincipalDep,
    registry: RegistryDep,
    settings: SettingsDep,
    idempotency_key: Annotated[
        str | None,
        Header(
            min_length=1,
            max_length=256,
            description="Retries with the same key answer with the job the first made.",
        ),
    ] = None,
) -> FastJSONResponse:
    def existing() -> Row[Any] | None:
        if idempotency_key is None:
            return None
        return session.execute(
            select(*JOB_COLUMNS).where(
                Job.tenant_id == principal.tenant_id, Job.idempotency_key == idempotency_key
            )
        ).first()

    # Insert first, look up on conflict: a first attempt (the common case) costs no extra
    # query, and the unique index settles concurrent retries.
    try:
        device = PlanDevice.from_gb(settings.device_memory_gb, settings.host_memory_gb)
        job = create_job(
            session,
            principal,
            body,
            registry,
            idempotency_key=idempotency_key,
            device=device,
            outbound=settings.outbound_policy,
            spaces=settings.tracking_spaces,
        )
        session.commit()
    except (IntegrityError, TuneFleetError):
        # A retry with the same Idempotency-Key answers with the job the first attempt
        # made, even if the request would not validate any more (its file was deleted).
        session.rollback()
        found = existing()
        if found is None:
            raise
        job = found
    return FastJSONResponse(job_view(job))


@router.get("", responses={**ok(JobList), **errors(404)})
async def list_jobs(
    request: Request,
    session: StatementSessionDep,
    principal: PrincipalDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> FastJSONResponse:
    query = select(*JOB_COLUMNS).where(Job.tenant_id == principal.tenant_id)
    anchor = None
    if after:
        found = session.get(Job, after)
        if found is None or found.tenant_id != principal.tenant_id:
            raise NotFound(f"no fine-tuning job with id {after!r}", param="after")
        anchor = (found.created_ns, found.id)
    wanted = _metadata_filter(request)
    ordered = ordered_after(query, Job.created_ns, Job.id, anchor)
    rows: list[Row[Any]] = []
    # Metadata is JSON, filtered here so SQLite and PostgreSQL agree; stop at limit + 1.
    for job in session.execute(ordered if wanted else ordered.limit(limit + 1)):
        if all((job.metadata_ or {}).get(k) == v for k, v in wanted.items()):
            rows.append(job)
            if len(rows) > limit:
                break
    return FastJSONResponse(
        {
            "object": "list",
            "data": [job_view(j) for j in rows[:limit]],
            "has_more": len(rows) > limit,
        }
    )


def _metadata_filter(request: Request) -> dict[str, str]:
    """``metadata[key]=value`` query parameters, as the OpenAI SDK sends them."""
    out: dict[str, str] = {}
    for key, value in request.query_params.multi_items():
        if key.startswith("metadata[") and key.endswith("]"):
            out[key[9:-1]] = value
    return out


@router.get("/{job_id}", responses={**ok(JobObject), **errors(404)})
async def retrieve(
    job_id: str, session: StatementSessionDep, principal: PrincipalDep
) -> FastJSONResponse:
    return FastJSONResponse(job_view(get_job(session, principal, job_id)))


@router.post("/{job_id}/cancel", responses={**ok(JobObject), **errors(404, 409)})
def cancel(job_id: str, session: SessionDep, principal: PrincipalDep) -> dict[str, Any]:
    return _move(session, principal, job_id, "cancel")


@router.post("/{job_id}/pause", responses={**ok(JobObject), **errors(404, 409)})
def pause(job_id: str, session: SessionDep, principal: PrincipalDep) -> dict[str, Any]:
    """A running job checkpoints at its next step and stops; a queued one just waits."""
    return _move(session, principal, job_id, "pause")


@router.post("/{job_id}/resume", responses={**ok(JobObject), **errors(404, 409)})
def resume(job_id: str, session: SessionDep, principal: PrincipalDep) -> dict[str, Any]:
    """Queue a paused job again; its next run continues from its newest checkpoint."""
    return _move(session, principal, job_id, "resume")


def _move(session: Session, principal: Principal, job_id: str, action: str) -> dict[str, Any]:
    """A tenant's request to move its job (``status.request_move``: a compare-and-set, 409 from
    any other state), committed; the job as it is now."""
    job = get_job(session, principal, job_id)
    request_move(session, job.id, action, Actor.of(principal, "api"))
    session.commit()
    session.refresh(job)
    return job_view(job)


@router.get("/{job_id}/events", responses={**ok(EventList), **errors(404)})
async def events(
    job_id: str,
    session: StatementSessionDep,
    principal: PrincipalDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 20,
    level: Literal["info", "warn", "error"] | None = None,
    type: Literal["message", "metrics"] | None = None,
) -> dict[str, Any]:
    job = get_job(session, principal, job_id)
    rows, has_more = list_events(session, job.id, after=after, limit=limit, level=level, type=type)
    return {"object": "list", "data": [event_view(e) for e in rows], "has_more": has_more}


@router.get("/{job_id}/checkpoints", responses={**ok(CheckpointList), **errors(404)})
async def checkpoints(
    job_id: str,
    session: StatementSessionDep,
    principal: PrincipalDep,
    store: StoreDep,
    after: Annotated[
        str | None, Query(description="A checkpoint id: list the older ones after it.")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 10,
) -> dict[str, Any]:
    """Newest step first (then by id, a total order for the ``after`` cursor)."""
    job = get_job(session, principal, job_id)
    anchor = None
    if after:
        found = session.get(Checkpoint, after)
        if found is None or found.job_id != job.id:
            raise NotFound(f"no checkpoint with id {after!r} for job {job.id}", param="after")
        anchor = (found.step, found.id)
    query = select(Checkpoint).where(Checkpoint.job_id == job.id)
    rows: list[Checkpoint] = []
    # Ray Train keeps the newest few checkpoints on disk; list only those that exist.
    for c in session.scalars(ordered_after(query, Checkpoint.step, Checkpoint.id, anchor)):
        if store.exists(c.path):
            rows.append(c)
            if len(rows) > limit:
                break
    data = [
        {
            "id": c.id,
            "object": "fine_tuning.job.checkpoint",
            "created_at": c.created_at,
            "fine_tuning_job_id": job.id,
            "fine_tuned_model_checkpoint": checkpoint_model_name(
                job, principal.tenant_name, c.step
            ),
            "step_number": c.step,
            "metrics": {"step": c.step, **c.metrics},
        }
        for c in rows[:limit]
    ]
    return {"object": "list", "data": data, "has_more": len(rows) > limit}
