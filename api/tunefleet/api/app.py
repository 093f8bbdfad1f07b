"""The FastAPI application factory."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from tunefleet.api.errors import install_error_handlers
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
    for module in (files, jobs, models, inference, plans, admin):
        app.include_router(module.router)

    @app.get("/healthz", tags=["ops"])
    def healthz() -> dict[str, Any]:
        return {"status": "ok"}

    return app
