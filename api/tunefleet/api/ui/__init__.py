"""The admin dashboard, served by the API under ``/ui``: server-rendered pages (Jinja2),
live parts refreshed by htmx (vendored under ``static/vendor/htmx``), charts drawn on the
server as SVG. Signed in with an API key; a tenant's key sees its tenant's objects, an
admin key every tenant's. See docs/dashboard.md.

``install(app)`` adds it to an app: its routes, its static files and the security headers
of every ``/ui`` answer.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

from tunefleet.api.ui import _actions as actions
from tunefleet.api.ui import _adapters as adapters
from tunefleet.api.ui import _admin as admin
from tunefleet.api.ui import _pages as pages
from tunefleet.api.ui import _planning as planning
from tunefleet.api.ui import _playground as playground
from tunefleet.api.ui._render import PREFIX, STATIC_DIR, SecurityHeaders


def install(app: FastAPI) -> None:
    app.include_router(pages.router)
    app.include_router(actions.router)
    app.include_router(planning.router)
    app.include_router(admin.router)
    app.include_router(adapters.router)
    app.include_router(playground.router)
    app.mount(f"{PREFIX}/static", StaticFiles(directory=STATIC_DIR), name="ui-static")
    app.add_middleware(SecurityHeaders)


__all__ = ["install"]
