"""The FastAPI application factory."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from tunefleet.api.body_limits import BodyLimitMiddleware
from tunefleet.api.errors import install_error_handlers
from tunefleet.api.openapi import Health, ok, openapi_document
from tunefleet.api.routes import admin, files, inference, jobs, models, plans
from tunefleet.platform.settings import Settings, get_settings


def create_app(settings: Settings | None = None) -> FastAPI:
    app = FastAPI(
        title="TuneFleet",
        version="0.1.0",
        description="Self-hosted fine-tuning: OpenAI-compatible files, fine-tuning jobs, "
        "models and chat completions.",
    )
    app.state.settings = settings or get_settings()
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, settings=app.state.settings)
    for module in (files, jobs, models, inference, plans, admin):
        app.include_router(module.router)

    @app.get("/healthz", tags=["ops"], responses=ok(Health))
    def healthz() -> dict[str, Any]:
        return {"status": "ok"}

    app.openapi = lambda: openapi_document(app)  # type: ignore[method-assign]
    return app
