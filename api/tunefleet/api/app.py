"""The FastAPI application factory."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Annotated, Any

import anyio.to_thread
import httpx
from fastapi import FastAPI, Header
from fastapi.responses import JSONResponse, Response
from sqlalchemy import text

from tunefleet.api._body_limits import BodyLimitMiddleware
from tunefleet.api._errors import install_error_handlers
from tunefleet.api._observe import RequestMetrics
from tunefleet.api._openapi import Health, Readiness, errors, ok, openapi_document
from tunefleet.api.routes import admin, evals, files, graders, inference, jobs, models, plans
from tunefleet.api.ui import install as install_dashboard
from tunefleet.platform.db import session_scope
from tunefleet.platform.errors import Unauthenticated
from tunefleet.platform.inference_limits import flush as flush_leases
from tunefleet.platform.metrics import exposition, scrape_allowed
from tunefleet.platform.settings import Settings, get_settings

log = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    yield
    await inference.close_serve_client()
    # finished requests' inference slots, queued for deletion, are freed now rather than
    # when their leases expire
    await anyio.to_thread.run_sync(flush_leases, app.state.settings.resolved_database_url)


def server_options(settings: Settings) -> dict[str, Any]:
    """uvicorn's options for the API, however it is run (``tunefleet api``, ``tunefleet
    up``, the tests' live servers): forwarded headers believed from
    ``settings.forwarded_allow_ips`` alone (uvicorn would read its own environment)."""
    return {
        "proxy_headers": True,
        "forwarded_allow_ips": settings.forwarded_allow_ips,
        "log_level": "warning",
    }


def create_app(settings: Settings | None = None) -> FastAPI:
    app = FastAPI(
        lifespan=_lifespan,
        title="TuneFleet",
        version="0.1.0",
        description="Self-hosted fine-tuning: OpenAI-compatible files, fine-tuning jobs, "
        "models and chat completions.",
    )
    app.state.settings = settings or get_settings()
    install_error_handlers(app)
    install_dashboard(app)  # /ui: pages, static files, their security headers
    app.add_middleware(BodyLimitMiddleware, settings=app.state.settings)
    app.add_middleware(RequestMetrics)  # outermost: every answer counted, refusals too
    for module in (files, jobs, models, inference, plans, graders, evals, admin):
        app.include_router(module.router)

    @app.get("/healthz", tags=["ops"], responses=ok(Health))
    def healthz() -> dict[str, Any]:
        """Alive (a liveness probe)."""
        return {"status": "ok"}

    @app.get(
        "/metrics",
        tags=["ops"],
        responses={
            **ok({"content": {"text/plain": {"schema": {"type": "string"}}}}, "Prometheus"),
            **errors(401),
        },
    )
    def metrics(authorization: Annotated[str | None, Header()] = None) -> Response:
        """Prometheus metrics: requests and latencies by route, jobs by status, the queue's
        length (``tunefleet.platform.metrics``). With ``TUNEFLEET_METRICS_TOKEN`` set, only
        for a bearer of it."""
        st: Settings = app.state.settings
        if not scrape_allowed(st.metrics_token, authorization):
            raise Unauthenticated(
                "/metrics needs the operator's metrics token as 'Authorization: Bearer "
                "<TUNEFLEET_METRICS_TOKEN>'"
            )
        body, content_type = exposition(st.resolved_database_url)
        return Response(body, media_type=content_type)

    not_ready: dict[int | str, dict[str, Any]] = {
        503: {"model": Readiness, "description": "Not ready: what is not."}
    }

    @app.get("/readyz", tags=["ops"], responses={**ok(Readiness), **not_ready})
    def readyz() -> JSONResponse:
        """Ready to serve (a readiness probe): the database answers and Ray's dashboard
        (its Jobs API, through which runs start) is reachable; 503 naming what is not."""
        st: Settings = app.state.settings
        checks = {"database": "ok", "ray": "ok"}
        try:
            with session_scope(st.resolved_database_url) as s:
                s.execute(text("SELECT 1"))
        except Exception as exc:
            log.warning("readyz: the database is unreachable: %s", exc)
            checks["database"] = f"unreachable: {type(exc).__name__}"
        dashboard = st.resolved_ray_dashboard_url
        try:  # any answer (401 without Ray's token included) means it is up
            httpx.get(f"{dashboard}/api/version", timeout=2)
        except httpx.HTTPError as exc:
            # where it was looked for goes to the log, not to whoever asks: no internal
            # address in an answer anyone reaching the API can read
            log.warning("readyz: Ray's dashboard at %s is unreachable: %s", dashboard, exc)
            checks["ray"] = f"unreachable: {type(exc).__name__}"
        ready = all(v == "ok" for v in checks.values())
        body = {"status": "ready" if ready else "not ready", **checks}
        return JSONResponse(body, status_code=200 if ready else 503)

    app.openapi = lambda: openapi_document(app)  # type: ignore[method-assign]
    return app
