"""The dashboard's pages (GET), each whole without JavaScript, and the fragments htmx polls
to keep them live (``.../live``, ``/ui/jobs/table``). Plain ``def`` routes: they read the
database and Ray's dashboard, off the event loop."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import HTMLResponse
from sqlalchemy.orm import Session

from tunefleet.api._deps import RegistryDep, SessionDep, SettingsDep, StoreDep
from tunefleet.api.ui import _charts as charts
from tunefleet.api.ui import _queries as queries
from tunefleet.api.ui._cluster import fetch_cluster
from tunefleet.api.ui._planning import memory_bars
from tunefleet.api.ui._render import UiRoute, page
from tunefleet.api.ui._session import Viewer, ViewerDep
from tunefleet.platform.db import Job
from tunefleet.platform.errors import InvalidRequest
from tunefleet.platform.jobs import job_view, list_events
from tunefleet.platform.models import ModelRegistry
from tunefleet.platform.planner import chart_of_plan
from tunefleet.platform.settings import Settings
from tunefleet.platform.status import LEVELS, REQUESTS, TERMINAL, JobStatus

router = APIRouter(prefix="/ui", route_class=UiRoute, include_in_schema=False)
MAX_COMPARED = 8
EVENT_TYPES = ("message", "metrics")
# What a successful action redirects with (?done=...): a fixed word, never echoed text.
DONE = {"cancel": "Cancel requested.", "pause": "Pause requested.", "resume": "Job resumed."}


# -- overview ---------------------------------------------------------------------------


def _overview(session: Session, viewer: Viewer, settings: Settings) -> dict[str, Any]:
    principal = viewer.principal
    # the cluster's machines are the operators' business: admin keys see them
    cluster = fetch_cluster(settings.resolved_ray_dashboard_url) if principal.is_admin else None
    return {
        "viewer": viewer,
        "waiting": queries.waiting_jobs(session, principal),
        "running": queries.running_jobs(session, principal),
        "failures": queries.recent_failures(session, principal),
        "cluster": cluster,
    }


@router.get("")
def overview(
    request: Request, viewer: ViewerDep, session: SessionDep, settings: SettingsDep
) -> HTMLResponse:
    return page(request, "overview.html", _overview(session, viewer, settings))


@router.get("/overview/live")
def overview_live(
    request: Request, viewer: ViewerDep, session: SessionDep, settings: SettingsDep
) -> HTMLResponse:
    return page(request, "_overview_live.html", _overview(session, viewer, settings))


# -- jobs -------------------------------------------------------------------------------


def _jobs(session: Session, viewer: Viewer, filters: queries.JobFilters) -> dict[str, Any]:
    rows, has_more = queries.list_jobs(session, viewer.principal, filters)
    return {
        "viewer": viewer,
        "filters": filters,
        "jobs": rows,
        "has_more": has_more,
        "tenants": queries.tenant_names(session, viewer.principal),
        "statuses": [s.value for s in JobStatus],
    }


def _filters(
    status: str = "", model: str = "", tenant: str = "", metadata: str = "", after: str = ""
) -> queries.JobFilters:
    """The jobs list's filters, from its query string (the page's and its fragment's)."""
    return queries.JobFilters(status, model, tenant, metadata, after)


FiltersDep = Annotated[queries.JobFilters, Depends(_filters)]


@router.get("/jobs")
def jobs(
    request: Request, viewer: ViewerDep, session: SessionDep, filters: FiltersDep
) -> HTMLResponse:
    try:
        context = _jobs(session, viewer, filters)
    except InvalidRequest as exc:  # a filter that cannot apply: say so beside the form
        context = {**_jobs(session, viewer, queries.JobFilters()), "problem": exc.message}
        context["filters"] = filters
        return page(request, "jobs.html", context, 400)
    return page(request, "jobs.html", context)


@router.get("/jobs/table")
def jobs_table(
    request: Request, viewer: ViewerDep, session: SessionDep, filters: FiltersDep
) -> HTMLResponse:
    return page(request, "_jobs_table.html", _jobs(session, viewer, filters))


def _live(session: Session, job: Job, log: bool) -> dict[str, Any]:
    """What the live part of a job's page shows: status, progress, figures, the chart and
    the actions the job's state allows."""
    curves = queries.loss_curves(session, job.id)
    series = [charts.Series("training loss", curves.train)]
    if curves.valid:
        series.append(charts.Series("validation loss", curves.valid))
    chart = charts.line_chart(
        series,
        title=f"Loss of {job.id}",
        desc=f"Training loss over {len(curves.train)} steps"
        + (f" and validation loss at {len(curves.valid)} steps" if curves.valid else "")
        + (", log scale." if log else "."),
        chart_id="loss",
        log_y=log,
    )
    status = JobStatus(job.status)
    actions = [name for name, (src, _, _) in REQUESTS.items() if status in src]
    return {
        "job": job,
        "live": status not in TERMINAL,
        "latest": curves.latest,
        "chart": chart,
        "legend": charts.legend(series),
        "points": len(curves.train),
        "log": log,
        "actions": actions,
    }


def _memory(registry: ModelRegistry, job: Job) -> dict[str, Any]:
    """The job's memory plan as the seeds' chart of bars, when it has a plan and its base
    model is still registered (the chart needs its config)."""
    if not job.plan or job.model not in registry.names():
        return {"memory_chart": None}
    try:
        plan = {**job.plan, "chart": chart_of_plan(registry.config(job.model), job.plan)}
    except (KeyError, TypeError):  # a plan stored by an older planner, without its input
        return {"memory_chart": None}
    return {
        "memory_chart": memory_bars(plan, title=f"Memory plan of {job.id}"),
        "memory_legend": charts.memory_legend(),
    }


@router.get("/jobs/{job_id}")
def job_page(
    request: Request,
    job_id: str,
    viewer: ViewerDep,
    session: SessionDep,
    store: StoreDep,
    registry: RegistryDep,
    scale: str = "linear",
    level: str = "",
    type: str = "",
    done: str = "",
) -> HTMLResponse:
    job = queries.visible_job(session, viewer.principal, job_id)
    asked, reasons = queries.asked_and_reasons(session, job)
    level = level if level in LEVELS else ""
    type = type if type in EVENT_TYPES else ""
    events, more_events = list_events(
        session, job.id, limit=50, level=level or None, type=type or None
    )
    timeline, _ = list_events(session, job.id, limit=100, type="message")
    context = {
        "viewer": viewer,
        **_live(session, job, scale == "log"),
        **_memory(registry, job),
        "done": DONE.get(done, ""),
        "tenant_name": queries.tenant_name(session, job.tenant_id),
        "view": job_view(job),
        "asked": asked,
        "reasons": reasons,
        "checkpoints": queries.checkpoints(session, store, job.id),
        "timeline": list(reversed(timeline)),
        "events": events,
        "more_events": more_events,
        "level": level,
        "levels": LEVELS,
        "type": type,
        "types": EVENT_TYPES,
    }
    return page(request, "job.html", context)


@router.get("/jobs/{job_id}/live")
def job_live(
    request: Request, job_id: str, viewer: ViewerDep, session: SessionDep, scale: str = "linear"
) -> HTMLResponse:
    job = queries.visible_job(session, viewer.principal, job_id)
    context = {"viewer": viewer, **_live(session, job, scale == "log")}
    return page(request, "_job_live.html", context)


# -- compare ----------------------------------------------------------------------------


@router.get("/compare")
def compare(
    request: Request,
    viewer: ViewerDep,
    session: SessionDep,
    job: Annotated[list[str], Query()] = [],  # noqa: B006 (FastAPI copies defaults)
    ids: str = "",
    scale: str = "linear",
) -> HTMLResponse:
    """Two or more jobs' training loss on one chart: ``?job=A&job=B`` or ``?ids=A,B``."""
    wanted = list(dict.fromkeys([*job, *ids.replace(",", " ").split()]))[:MAX_COMPARED]
    found = [queries.visible_job(session, viewer.principal, j) for j in wanted]
    series = [
        charts.Series(
            j.id + (f" ({j.fine_tuned_model})" if j.fine_tuned_model else ""),
            queries.loss_curves(session, j.id).train,
        )
        for j in found
    ]
    chart, key = None, charts.legend(series)
    if series:
        chart = charts.line_chart(
            series,
            title="Training loss of " + ", ".join(j.id for j in found),
            desc=f"Training loss by step of {len(found)} jobs"
            + (", log scale." if scale == "log" else "."),
            chart_id="compare",
            log_y=scale == "log",
        )
    context = {
        "viewer": viewer,
        "ids": " ".join(wanted),
        "jobs": found,
        "chart": chart,
        "legend": key,
        "log": scale == "log",
        "most": MAX_COMPARED,
    }
    return page(request, "compare.html", context)


# -- files ------------------------------------------------------------------------------


@router.get("/files")
def files(request: Request, viewer: ViewerDep, session: SessionDep) -> HTMLResponse:
    context = {
        "viewer": viewer,
        "files": queries.list_files(session, viewer.principal),
        "tenants": queries.tenant_names(session, viewer.principal),
    }
    return page(request, "files.html", context)


@router.get("/files/{file_id}")
def file_page(
    request: Request, file_id: str, viewer: ViewerDep, session: SessionDep, store: StoreDep
) -> HTMLResponse:
    f = queries.visible_file(session, viewer.principal, file_id)
    head: list[str] = []
    more, problem, hidden = False, "", f.tenant_id != viewer.principal.tenant_id
    # Another tenant's content is not shown to admins, as REST's /content refuses it: it is
    # the tenant's data (often its customers'); the metadata, status and validation errors
    # on this page are what running the platform needs. Refused rather than audited: an
    # entry records a read after the fact, and does not keep the data private.
    if not hidden:
        try:
            head, more = queries.file_head(store, f.path)
        except OSError as exc:  # the stored object is gone or unreadable: say so
            problem = f"the file's content could not be read ({type(exc).__name__})"
    context = {
        "viewer": viewer,
        "file": f,
        "head": head,
        "more": more,
        "problem": problem,
        "hidden": hidden,
        "used_by": queries.jobs_using(session, viewer.principal, f.id),
        "tenant_name": queries.tenant_name(session, f.tenant_id),
    }
    return page(request, "file.html", context)
