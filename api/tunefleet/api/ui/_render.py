"""Rendering the dashboard: the Jinja2 templates and their filters, the route class that
turns errors into pages, and the security headers every ``/ui`` answer carries."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

from fastapi import Request, Response
from fastapi.responses import HTMLResponse, RedirectResponse
from fastapi.routing import APIRoute
from fastapi.templating import Jinja2Templates
from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tunefleet.api.ui._session import CSRF_FIELD, CSRF_HEADER, SignInRequired, read_session
from tunefleet.platform.errors import TuneFleetError

HERE = Path(__file__).parent
STATIC_DIR = HERE / "static"
PREFIX = "/ui"

# No inline script or style anywhere (templates use classes and ui.css, htmx reads its
# config from a meta tag), so the policy can forbid both.
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "frame-ancestors 'none'; form-action 'self'; base-uri 'none'; object-src 'none'"
)
SECURITY_HEADERS = {
    "content-security-policy": CSP,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "x-frame-options": "DENY",
}


def _when(ts: int | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts)) if ts else "—"


def _num(value: Any, digits: int = 4) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "—" if value is None else str(value)
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.{digits}g}"


def _size(n: Any) -> str:
    if not isinstance(n, int | float) or isinstance(n, bool):
        return "—"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def _pretty(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, default=str)


def _environment() -> Environment:
    env = Environment(
        loader=FileSystemLoader(HERE / "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(when=_when, num=_num, size=_size, pretty=_pretty)
    env.globals.update(CSRF_FIELD=CSRF_FIELD, CSRF_HEADER=CSRF_HEADER, PREFIX=PREFIX)
    return env


templates = Jinja2Templates(env=_environment())


def page(
    request: Request, name: str, context: dict[str, Any], status_code: int = 200
) -> HTMLResponse:
    """Template ``name`` with ``context`` (which names the ``viewer``, or None)."""
    context.setdefault("viewer", None)
    context.setdefault("hx_headers", _hx_headers(context["viewer"]))
    return templates.TemplateResponse(request, name, context, status_code=status_code)


def _hx_headers(viewer: Any) -> str:
    """htmx's ``hx-headers`` on <body>: every request it makes carries the CSRF token."""
    return json.dumps({CSRF_HEADER: viewer.csrf}) if viewer is not None else "{}"


def error_page(request: Request, status_code: int, message: str) -> HTMLResponse:
    session = read_session(request)
    signed_in = session is not None and session.key_id is not None
    context = {"status_code": status_code, "message": message, "signed_in": signed_in}
    return page(request, "error.html", context, status_code)


def sign_in_redirect(request: Request, reason: str = "") -> Response:
    """Back to the sign-in page, which returns to this page afterwards (a GET's own URL,
    the page an htmx fragment was polled from, the overview after a POST). htmx is told
    to load it as a whole page (``HX-Redirect``) rather than swap it into a fragment."""
    htmx = bool(request.headers.get("hx-request"))
    target = PREFIX
    if htmx:
        current = urlsplit(request.headers.get("hx-current-url", ""))
        target = current.path + (f"?{current.query}" if current.query else "")
    elif request.method == "GET":
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    params = {"next": target, **({"ended": "revoked"} if reason else {})}
    url = f"{PREFIX}/signin?{urlencode(params)}"
    if htmx:
        return Response(status_code=200, headers={"HX-Redirect": url})
    return RedirectResponse(url, status_code=303)


def safe_next(target: str | None) -> str:
    """Where to go after signing in: a dashboard path, never another site."""
    if target and target.startswith(PREFIX) and not target.startswith("//"):
        parts = urlsplit(target)
        if not parts.scheme and not parts.netloc:
            return target
    return PREFIX


class UiRoute(APIRoute):
    """A dashboard route: domain errors (404, 409, 403 ...) become HTML pages that say
    what happened, and a request without a live session goes to the sign-in page."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            try:
                return await handler(request)
            except SignInRequired as exc:
                return sign_in_redirect(request, exc.reason)
            except TuneFleetError as exc:
                return error_page(request, exc.status_code, exc.message)

        return handle


class SecurityHeaders:
    """Adds ``SECURITY_HEADERS`` (and ``Cache-Control: no-store`` on pages, which hold a
    tenant's data) to every answer under ``/ui``: pages, fragments, static files and
    errors alike."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope.get("path", "")
        if scope["type"] != "http" or not (path == PREFIX or path.startswith(PREFIX + "/")):
            await self.app(scope, receive, send)
            return
        static = path.startswith(PREFIX + "/static/")

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in SECURITY_HEADERS.items():
                    headers[name] = value
                if not static:
                    headers["cache-control"] = "no-store"
            await send(message)

        await self.app(scope, receive, sending)
