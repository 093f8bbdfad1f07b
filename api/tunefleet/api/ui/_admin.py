"""The dashboard's admin page (``/ui/admin``, admin keys only): tenants with their quotas
and active jobs, their API keys; forms to add a tenant, change its quotas, add a key (shown
once, on the answer to the form, never in a URL) and revoke one. The same platform calls
and request bounds as the admin REST routes (``routes/admin.py``); each change is in the
audit log (``platform.audit``) with the admin key that made it, whose newest entries the
page lists."""

from __future__ import annotations

import logging
from typing import Annotated, Any

from fastapi import APIRouter, Form, Request, Response
from fastapi.responses import HTMLResponse, RedirectResponse
from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session

from tunefleet.api._deps import SessionDep
from tunefleet.api.routes.admin import KeyCreate, TenantCreate, TenantUpdate
from tunefleet.api.ui._render import PREFIX, UiRoute, page
from tunefleet.api.ui._session import CsrfDep, Viewer, ViewerDep
from tunefleet.platform import audit
from tunefleet.platform.audit import Actor
from tunefleet.platform.db import ApiKey, Tenant
from tunefleet.platform.errors import Forbidden, TuneFleetError
from tunefleet.platform.tenants import (
    QUOTAS,
    active_jobs_by_tenant,
    create_key,
    create_tenant,
    get_tenant,
    revoke_key,
    set_quotas,
)

router = APIRouter(prefix="/ui/admin", route_class=UiRoute, include_in_schema=False)
log = logging.getLogger(__name__)
DONE = {"quotas": "Quotas saved.", "revoked": "Key revoked."}
AUDIT_SHOWN = 50  # the newest audit entries the page lists
Text = Annotated[str, Form(max_length=200)]


def _admin(viewer: Viewer) -> Viewer:
    if not viewer.principal.is_admin:
        raise Forbidden(
            f"the admin page needs an admin key; tenant {viewer.principal.tenant_name!r}'s "
            "key is not one (`tunefleet admin create-key TENANT --admin`)"
        )
    return viewer


def _context(request: Request, session: Session, viewer: Viewer, **more: Any) -> dict[str, Any]:
    keys: dict[str, list[ApiKey]] = {}
    for key in session.scalars(select(ApiKey).order_by(ApiKey.created_at.desc(), ApiKey.id)):
        keys.setdefault(key.tenant_id, []).append(key)
    tenants = list(session.scalars(select(Tenant).order_by(Tenant.created_at, Tenant.name)))
    return {
        "viewer": viewer,
        "nav": "admin",
        "tenants": tenants,
        "tenant_names": {t.id: t.name for t in tenants},
        "audit": audit.entries(session, limit=AUDIT_SHOWN)[0],
        "active": active_jobs_by_tenant(session),
        "keys": keys,
        "quotas": QUOTAS,
        "defaults": request.app.state.settings,  # the inference limits' defaults
        "problem": "",
        "done": "",
        **more,
    }


def _refused(request: Request, session: Session, viewer: Viewer, exc: Exception) -> Response:
    """The admin page again, saying why a form was refused."""
    session.rollback()
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        message, status = f"{'.'.join(map(str, first['loc']))}: {first['msg']}", 400
    else:
        assert isinstance(exc, TuneFleetError)
        message, status = exc.message, exc.status_code
    return page(request, "admin.html", _context(request, session, viewer, problem=message), status)


def _shown_once(
    request: Request, viewer: Viewer, tenant: Tenant, key: ApiKey, secret: str
) -> Response:
    context = {"viewer": viewer, "nav": "admin", "tenant": tenant, "key": key, "secret": secret}
    return page(request, "key_once.html", context)


@router.get("")
def admin_page(
    request: Request, viewer: ViewerDep, session: SessionDep, done: str = ""
) -> HTMLResponse:
    context = _context(request, session, _admin(viewer), done=DONE.get(done, ""))
    return page(request, "admin.html", context)


@router.post("/tenants")
def add_tenant(
    request: Request,
    _: CsrfDep,
    viewer: ViewerDep,
    session: SessionDep,
    name: Text = "",
    max_concurrent_jobs: Text = "4",
    max_gpus: Text = "8",
    max_waiting_jobs: Text = "100",
) -> Response:
    """A tenant and its first key, shown once."""
    _admin(viewer)
    try:
        body = TenantCreate.model_validate(
            {
                "name": name.strip(),
                "max_concurrent_jobs": max_concurrent_jobs,
                "max_gpus": max_gpus,
                "max_waiting_jobs": max_waiting_jobs,
            }
        )
        actor = Actor.of(viewer.principal, "dashboard")
        tenant = create_tenant(session, body.name, actor=actor, **body.model_dump(exclude={"name"}))
        key, secret = create_key(session, tenant.id, name="initial", actor=actor)
        session.commit()
    except (ValidationError, TuneFleetError) as exc:
        return _refused(request, session, viewer, exc)
    log.info("admin key %s added tenant %s (%s)", viewer.principal.key_id, tenant.id, tenant.name)
    return _shown_once(request, viewer, tenant, key, secret)


@router.post("/tenants/{tenant_id}/quotas")
def change_quotas(
    request: Request,
    tenant_id: str,
    _: CsrfDep,
    viewer: ViewerDep,
    session: SessionDep,
    max_concurrent_jobs: Text = "",
    max_gpus: Text = "",
    max_waiting_jobs: Text = "",
    inference_requests_per_s: Text = "",
    inference_concurrent_requests: Text = "",
) -> Response:
    _admin(viewer)
    sent = {"max_concurrent_jobs": max_concurrent_jobs, "max_gpus": max_gpus,
            "max_waiting_jobs": max_waiting_jobs}  # fmt: skip
    # an inference limit left empty is the operator's default
    limits = {
        "inference_requests_per_s": inference_requests_per_s.strip() or None,
        "inference_concurrent_requests": inference_concurrent_requests.strip() or None,
    }
    try:
        body = TenantUpdate.model_validate(
            {**{k: v.strip() for k, v in sent.items() if v.strip()}, **limits}
        )
        changes = body.model_dump(exclude_unset=True)
        tenant = set_quotas(
            session, tenant_id, actor=Actor.of(viewer.principal, "dashboard"), **changes
        )
        session.commit()
    except (ValidationError, TuneFleetError) as exc:
        return _refused(request, session, viewer, exc)
    log.info("admin key %s set quotas of tenant %s: %s", viewer.principal.key_id, tenant.id,
             changes)  # fmt: skip
    return RedirectResponse(f"{PREFIX}/admin?done=quotas#tenant-{tenant.id}", status_code=303)


@router.post("/tenants/{tenant_id}/keys")
def add_key(
    request: Request,
    tenant_id: str,
    _: CsrfDep,
    viewer: ViewerDep,
    session: SessionDep,
    name: Text = "",
    admin: Text = "",
) -> Response:
    """A new key for the tenant, shown once."""
    _admin(viewer)
    try:
        body = KeyCreate.model_validate({"name": name.strip(), "admin": admin == "on"})
        tenant = get_tenant(session, tenant_id)
        key, secret = create_key(
            session,
            tenant.id,
            name=body.name,
            is_admin=body.admin,
            actor=Actor.of(viewer.principal, "dashboard"),
        )
        session.commit()
    except (ValidationError, TuneFleetError) as exc:
        return _refused(request, session, viewer, exc)
    log.info("admin key %s added key %s (%s) to tenant %s", viewer.principal.key_id, key.id,
             "admin" if key.is_admin else "tenant", tenant.id)  # fmt: skip
    return _shown_once(request, viewer, tenant, key, secret)


@router.post("/keys/{key_id}/revoke")
def revoke(
    request: Request, key_id: str, _: CsrfDep, viewer: ViewerDep, session: SessionDep
) -> Response:
    """Revoke a key; revoking the key of this very session signs it out at its next page."""
    _admin(viewer)
    try:
        key = revoke_key(session, key_id, actor=Actor.of(viewer.principal, "dashboard"))
        session.commit()
    except TuneFleetError as exc:
        return _refused(request, session, viewer, exc)
    log.info("admin key %s revoked key %s of tenant %s", viewer.principal.key_id, key.id,
             key.tenant_id)  # fmt: skip
    return RedirectResponse(f"{PREFIX}/admin?done=revoked#tenant-{key.tenant_id}", status_code=303)
