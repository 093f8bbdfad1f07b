"""Dashboard sessions: a signed cookie that names an API key by its id, and the CSRF token
that every form and htmx request carries.

The session cookie (``tunefleet_session``: HttpOnly, SameSite=Strict, Path=/ui, Secure over
HTTPS) holds ``{"k": key id, "c": CSRF token}``, signed with the dashboard's key
(``TUNEFLEET_UI_SECRET``, or ``data_dir/ui-secret`` made once) and dated: itsdangerous
refuses it once ``ui_session_hours`` have passed. The key itself is never stored; each
request reads the key's row again (``tenants.principal_for_key``), so a revoked key's
sessions end at once. Signing out records the session (its CSRF token's hash) as ended
until its cookie would have expired (``ui_ended_sessions``): a copy of the cookie is
refused from then on, by every API process.

The sign-in form is CSRF-checked too, with a token of its own in a cookie of its own
(``tunefleet_signin``, Path=/ui/signin, an hour): a browser that arrives from another site
does not send a SameSite=Strict session cookie, and the sign-in page it is sent to must not
overwrite the session it cannot see. Signing in makes a new session and a new token.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request, Response
from itsdangerous import BadSignature, URLSafeTimedSerializer
from sqlalchemy import delete
from sqlalchemy.orm import Session

from tunefleet.platform.db import EndedUiSession, now_s, single_statement_sessions
from tunefleet.platform.errors import Forbidden, Unauthenticated
from tunefleet.platform.local_secrets import persisted_secret
from tunefleet.platform.settings import Settings
from tunefleet.platform.tenants import Principal, principal_for_key

COOKIE = "tunefleet_session"
COOKIE_PATH = "/ui"
SIGNIN_COOKIE = "tunefleet_signin"
SIGNIN_PATH = "/ui/signin"
SIGNIN_MAX_AGE_S = 3600
SECRET_FILE = "ui-secret"
CSRF_FIELD = "csrf_token"
CSRF_HEADER = "X-CSRF-Token"
_SALT = "tunefleet.ui.session"


@dataclass(frozen=True)
class UiSession:
    """What the cookie holds: the signed-in key's id (None before sign-in) and the CSRF
    token of this session."""

    csrf: str
    key_id: str | None = None

    @staticmethod
    def new(key_id: str | None = None) -> UiSession:
        return UiSession(csrf=secrets.token_urlsafe(32), key_id=key_id)


@dataclass(frozen=True)
class Viewer:
    """A signed-in request: who (scoping every query) and the token its forms carry."""

    principal: Principal
    csrf: str


class SignInRequired(Exception):
    """No session, an expired one, or one whose key was revoked: back to the sign-in page
    (``reason`` is shown there)."""

    def __init__(self, reason: str = "") -> None:
        super().__init__(reason)
        self.reason = reason


def _settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def _serializer(settings: Settings, cookie: str) -> URLSafeTimedSerializer:
    secret = settings.ui_secret or persisted_secret(settings.data_dir.resolve(), SECRET_FILE)
    return URLSafeTimedSerializer(secret, salt=f"{_SALT}.{cookie}")


def _cookie(request: Request, signin: bool) -> tuple[str, str, int]:
    """Name, path and lifetime (seconds) of the session or the sign-in cookie."""
    if signin:
        return SIGNIN_COOKIE, SIGNIN_PATH, SIGNIN_MAX_AGE_S
    return COOKIE, COOKIE_PATH, int(_settings(request).ui_session_hours * 3600)


def read_session(request: Request, *, signin: bool = False) -> UiSession | None:
    """The request's session (or its sign-in form's), or None: no cookie, a bad signature,
    or expired."""
    name, _, max_age = _cookie(request, signin)
    raw = request.cookies.get(name)
    if not raw:
        return None
    try:
        data = _serializer(_settings(request), name).loads(raw, max_age=max_age)
    except BadSignature:  # SignatureExpired is one
        return None
    if not isinstance(data, dict) or not isinstance(data.get("c"), str):
        return None
    key_id = data.get("k")
    return UiSession(csrf=data["c"], key_id=key_id if isinstance(key_id, str) else None)


def write_session(
    request: Request, response: Response, session: UiSession, *, signin: bool = False
) -> None:
    name, path, max_age = _cookie(request, signin)
    response.set_cookie(
        name,
        _serializer(_settings(request), name).dumps({"k": session.key_id, "c": session.csrf}),
        max_age=max_age,
        path=path,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


def clear_session(request: Request, response: Response, *, signin: bool = False) -> None:
    name, path, _ = _cookie(request, signin)
    response.delete_cookie(name, path=path, httponly=True, samesite="strict")


def viewer(request: Request) -> Viewer:
    """The signed-in principal, read afresh from its key's row (a revoked key signs out at
    once), or ``SignInRequired``."""
    session = read_session(request)
    if session is None or session.key_id is None:
        raise SignInRequired()
    url = _settings(request).resolved_database_url
    try:
        with single_statement_sessions(url)() as db:
            if db.get(EndedUiSession, _token_hash(session.csrf)) is not None:
                raise SignInRequired()  # signed out: a copy of its cookie
            principal = principal_for_key(db, session.key_id)
    except Unauthenticated as exc:
        raise SignInRequired("Your session ended: its API key was revoked.") from exc
    return Viewer(principal=principal, csrf=session.csrf)


def _token_hash(csrf: str) -> str:
    return hashlib.sha256(csrf.encode()).hexdigest()


def end_session(request: Request, db: Session, session: UiSession) -> None:
    """Record ``session`` as signed out until its cookie would have expired, and forget
    the sessions whose cookies have expired since."""
    now = now_s()
    _, _, max_age = _cookie(request, signin=False)
    db.execute(delete(EndedUiSession).where(EndedUiSession.expires_at < now))
    db.merge(EndedUiSession(token_hash=_token_hash(session.csrf), expires_at=now + max_age))


async def _checked(request: Request, session: UiSession | None) -> UiSession:
    """``session`` when the request's CSRF token (header ``X-CSRF-Token`` or form field
    ``csrf_token``) is its token; ``Forbidden`` (403) otherwise."""
    sent = request.headers.get(CSRF_HEADER)
    if sent is None and request.headers.get("content-type", "").startswith(
        ("application/x-www-form-urlencoded", "multipart/form-data")
    ):
        field = (await request.form()).get(CSRF_FIELD)
        sent = field if isinstance(field, str) else None
    if session is None:
        raise Forbidden(
            "refused: this form came without a dashboard session, so its CSRF token cannot "
            "be checked (cookies off, or the session expired); reload the page and send it "
            "again",
            code="csrf_failed",
        )
    if not sent or not hmac.compare_digest(sent.encode(), session.csrf.encode()):
        raise Forbidden(
            "refused: the form's CSRF token is missing or does not match this session; "
            "reload the page and send it again",
            code="csrf_failed",
        )
    return session


async def check_csrf(request: Request) -> UiSession:
    """The session of a POST that carries its CSRF token, or 403."""
    return await _checked(request, read_session(request))


async def check_signin_csrf(request: Request) -> UiSession:
    """The sign-in form's session, when the form carries its CSRF token, or 403."""
    return await _checked(request, read_session(request, signin=True))


ViewerDep = Annotated[Viewer, Depends(viewer)]
CsrfDep = Annotated[UiSession, Depends(check_csrf)]
SignInCsrfDep = Annotated[UiSession, Depends(check_signin_csrf)]
