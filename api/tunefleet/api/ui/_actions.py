"""The dashboard's actions (POST, each CSRF-checked): sign in, sign out, and pause, resume
or cancel a job through the same state-machine call the REST routes make
(``status.request_move``). A success redirects (303) to a page; a refusal renders the
page again with its reason."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Form, Request, Response
from fastapi.responses import HTMLResponse, RedirectResponse

from tunefleet.api._deps import SessionDep
from tunefleet.api.ui import _queries as queries
from tunefleet.api.ui._render import PREFIX, UiRoute, page, safe_next
from tunefleet.api.ui._session import (
    CsrfDep,
    SignInCsrfDep,
    UiSession,
    ViewerDep,
    clear_session,
    end_session,
    read_session,
    write_session,
)
from tunefleet.platform.audit import Actor
from tunefleet.platform.errors import Conflict, Unauthenticated
from tunefleet.platform.status import request_move
from tunefleet.platform.tenants import authenticate

router = APIRouter(prefix="/ui", route_class=UiRoute, include_in_schema=False)
ENDED = {"revoked": "Your session ended: its API key was revoked. Sign in with another key."}


@router.get("/signin")
def sign_in_form(request: Request, next: str = "", ended: str = "") -> HTMLResponse:
    """The sign-in form, with the CSRF token of its own cookie (made on the first visit)."""
    form = read_session(request, signin=True)
    fresh = form is None
    if form is None:
        form = UiSession.new()
    context = {"csrf": form.csrf, "next": safe_next(next), "notice": ENDED.get(ended, "")}
    response = page(request, "signin.html", context)
    if fresh:
        write_session(request, response, form, signin=True)
    return response


@router.post("/signin")
def sign_in(
    request: Request,
    form: SignInCsrfDep,
    db: SessionDep,
    api_key: Annotated[str, Form(max_length=200)] = "",
    next: Annotated[str, Form(max_length=2000)] = "",
) -> Response:
    """Check the key as the API does (``tenants.authenticate``) and start a session that
    names the key by its id, with a new CSRF token."""
    try:
        principal = authenticate(db, f"Bearer {api_key.strip()}")
    except Unauthenticated as exc:
        context = {"csrf": form.csrf, "next": safe_next(next), "problem": exc.message}
        return page(request, "signin.html", context, 401)
    response = RedirectResponse(safe_next(next), status_code=303)
    write_session(request, response, UiSession.new(principal.key_id))
    clear_session(request, response, signin=True)
    return response


@router.post("/signout")
def sign_out(request: Request, session: CsrfDep, db: SessionDep) -> Response:
    """End the session here and for any copy of its cookie, and clear the cookie."""
    end_session(request, db, session)
    db.commit()
    response = RedirectResponse(f"{PREFIX}/signin", status_code=303)
    clear_session(request, response)
    return response


@router.post("/jobs/{job_id}/{action}")
def job_action(
    request: Request,
    job_id: str,
    action: Literal["cancel", "pause", "resume"],
    _: CsrfDep,
    viewer: ViewerDep,
    db: SessionDep,
) -> Response:
    """Pause, resume or cancel a job the viewer sees; a move the job's state does not allow
    is answered 409 with the state machine's reason, on the job's page."""
    job = queries.visible_job(db, viewer.principal, job_id)
    try:
        request_move(db, job.id, action, Actor.of(viewer.principal, "dashboard"))
        db.commit()
    except Conflict as exc:
        db.rollback()
        context = {"viewer": viewer, "job_id": job.id, "message": exc.message}
        return page(request, "refused.html", context, 409)
    return RedirectResponse(f"{PREFIX}/jobs/{job.id}?done={action}", status_code=303)
