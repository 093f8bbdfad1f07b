"""The dashboard's adapters page (``/ui/adapters``): each fine-tuned model a viewer may call,
how it is served (merged into its own copy of the base, or multiplexed on the shared
base; pinned or not), who it is shared with, which replicas hold it, and its requests,
tokens and latency from the replicas' metrics (``usage.py``). Its owner shares and
unshares it; an admin key also switches its serving mode and pins it. The same platform
calls as ``/v1/models/{model}/shares`` and ``PATCH /v1/admin/adapters/{model}``."""

from __future__ import annotations

import logging
from typing import Annotated, Any
from urllib.parse import quote

from fastapi import APIRouter, Form, Request, Response
from fastapi.responses import HTMLResponse, RedirectResponse
from sqlalchemy import select
from sqlalchemy.orm import Session

from tunefleet.api._deps import SessionDep, SettingsDep
from tunefleet.api.ui._cluster import fetch_cluster
from tunefleet.api.ui._render import PREFIX, UiRoute, page
from tunefleet.api.ui._session import CsrfDep, Viewer, ViewerDep
from tunefleet.api.ui._usage import UsageView, fetch_usage
from tunefleet.platform.audit import Actor
from tunefleet.platform.db import Adapter, Tenant
from tunefleet.platform.errors import Forbidden, InvalidRequest, TuneFleetError
from tunefleet.platform.serving import (
    owned_adapter,
    set_serving,
    share,
    shares,
    unshare,
    visible_adapters,
)
from tunefleet.platform.settings import Settings

router = APIRouter(prefix="/ui/adapters", route_class=UiRoute, include_in_schema=False)
log = logging.getLogger(__name__)
DONE = {
    "merged": "Switched to merged serving; replicas apply it within a few seconds.",
    "multiplexed": "Switched to multiplexed serving; replicas apply it within a few seconds.",
    "pinned": "Pinned: replicas keep it loaded.",
    "unpinned": "Unpinned: replicas may evict it when their cache is full.",
    "shared": "Shared.",
    "unshared": "No longer shared.",
}


def _rows(session: Session, viewer: Viewer) -> list[tuple[Adapter, str]]:
    principal = viewer.principal
    if not principal.is_admin:
        return visible_adapters(session, principal.tenant_id)
    query = (
        select(Adapter, Tenant.name)
        .join(Tenant, Tenant.id == Adapter.tenant_id)
        .order_by(Adapter.created_at, Adapter.id)
    )
    return [(a, name) for a, name in session.execute(query)]


def _usage(settings: Settings, viewer: Viewer) -> UsageView:
    cluster = fetch_cluster(settings.resolved_ray_dashboard_url)
    usage = fetch_usage(cluster, settings.ray_metrics_port)
    if not viewer.principal.is_admin:  # where the cluster is, is the operators' business
        usage.errors = ["serving figures are not available right now"] if usage.errors else []
    return usage


def _context(session: Session, viewer: Viewer, settings: Settings, **more: Any) -> dict[str, Any]:
    rows = _rows(session, viewer)
    principal = viewer.principal
    mine = {a.id for a, _ in rows if a.tenant_id == principal.tenant_id}
    return {
        "viewer": viewer,
        "nav": "adapters",
        "rows": rows,
        "mine": mine,
        "shares": {a.id: shares(session, a) for a, _ in rows if a.id in mine or principal.is_admin},
        "usage": _usage(settings, viewer) if rows else UsageView(),
        "problem": "",
        "done": "",
        **more,
    }


@router.get("")
def adapters_page(
    request: Request, viewer: ViewerDep, session: SessionDep, settings: SettingsDep, done: str = ""
) -> HTMLResponse:
    context = _context(session, viewer, settings, done=DONE.get(done, ""))
    return page(request, "adapters.html", context)


def _back(adapter: Adapter, done: str) -> Response:
    anchor = quote(f"adapter-{adapter.job_id}")
    return RedirectResponse(f"{PREFIX}/adapters?done={done}#{anchor}", status_code=303)


def _refused(
    request: Request, session: Session, viewer: Viewer, settings: Settings, exc: TuneFleetError
) -> Response:
    session.rollback()
    context = _context(session, viewer, settings, problem=exc.message)
    return page(request, "adapters.html", context, exc.status_code)


Name = Annotated[str, Form(max_length=600)]


@router.post("/serving")
def change_serving(
    request: Request,
    _: CsrfDep,
    viewer: ViewerDep,
    session: SessionDep,
    settings: SettingsDep,
    model: Name,
    change: Annotated[str, Form(max_length=20)],
) -> Response:
    """``change`` one of merged, multiplexed, pin, unpin (admin keys: replicas are shared
    by every tenant)."""
    try:
        if not viewer.principal.is_admin:
            raise Forbidden(
                "changing how a model is served needs an admin key: replicas are shared by "
                "every tenant's models"
            )
        actor = Actor.of(viewer.principal, "dashboard")
        if change in ("merged", "multiplexed"):
            adapter = set_serving(session, model, mode=change, actor=actor)
        elif change in ("pin", "unpin"):
            adapter = set_serving(session, model, pinned=change == "pin", actor=actor)
        else:
            raise InvalidRequest(
                f"{change!r} is not a serving change; use merged, multiplexed, pin or unpin",
                param="change",
            )
        session.commit()
    except TuneFleetError as exc:
        return _refused(request, session, viewer, settings, exc)
    log.info("admin key %s: %s %s", viewer.principal.key_id, change, model)
    return _back(adapter, {"pin": "pinned", "unpin": "unpinned"}.get(change, change))


@router.post("/shares")
def change_shares(
    request: Request,
    _: CsrfDep,
    viewer: ViewerDep,
    session: SessionDep,
    settings: SettingsDep,
    model: Name,
    tenant: Annotated[str, Form(max_length=64)],
    change: Annotated[str, Form(max_length=20)] = "share",
) -> Response:
    """Share the viewer's own model with a tenant (by name), or stop sharing it."""
    try:
        if change not in ("share", "unshare"):
            raise InvalidRequest(f"{change!r} is not share or unshare", param="change")
        adapter = owned_adapter(session, viewer.principal.tenant_id, model)
        (share if change == "share" else unshare)(session, adapter, tenant.strip())
        session.commit()
    except TuneFleetError as exc:
        return _refused(request, session, viewer, settings, exc)
    return _back(adapter, "shared" if change == "share" else "unshared")
