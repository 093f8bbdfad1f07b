"""The dashboard's playground (``/ui/playground``): up to three models (a base model, its
fine-tuned models, checkpoints: whatever the key may call) answer one prompt side by side,
streamed, each with its tokens/s and time to first token. The page's script
(``static/playground.js``) posts each column to ``/ui/playground/chat``, which passes an
OpenAI chat request with ``stream: true`` to Serve through the same call as
``POST /v1/chat/completions`` (``routes.inference.forward``) and relays its events."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tunefleet.api._deps import RegistryDep, SessionDep, SettingsDep, StoreDep
from tunefleet.api.routes.inference import forward
from tunefleet.api.ui._render import UiRoute, page
from tunefleet.api.ui._session import CsrfDep, ViewerDep
from tunefleet.platform.errors import TuneFleetError
from tunefleet.platform.serving import visible_adapters

router = APIRouter(prefix="/ui/playground", route_class=UiRoute, include_in_schema=False)
COLUMNS = 3


class PlaygroundAsk(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1, max_length=600)
    prompt: str = Field(min_length=1, max_length=8000)
    max_tokens: int = Field(default=128, ge=1, le=2048)
    temperature: float = Field(default=0.0, ge=0, le=2)


@router.get("")
def playground_page(
    request: Request, viewer: ViewerDep, session: SessionDep, registry: RegistryDep
) -> HTMLResponse:
    bases = registry.names()
    adapters = [a.name for a, _ in visible_adapters(session, viewer.principal.tenant_id)]
    # the first column the base, the next ones its newest fine-tuned models
    defaults = [bases[0] if bases else "", *reversed(adapters)][:COLUMNS]
    defaults += [""] * (COLUMNS - len(defaults))
    context = {
        "viewer": viewer,
        "nav": "playground",
        "bases": bases,
        "adapters": adapters,
        "defaults": defaults,
    }
    return page(request, "playground.html", context)


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": code}}, status_code=status)


@router.post("/chat")
async def playground_chat(
    request: Request,
    _: CsrfDep,
    viewer: ViewerDep,
    session: SessionDep,
    registry: RegistryDep,
    settings: SettingsDep,
    store: StoreDep,
) -> Response:
    """One column's answer, streamed as OpenAI's chat chunks; errors as an OpenAI error
    object (the script shows their message)."""
    try:
        ask = PlaygroundAsk.model_validate(json.loads(await request.body()))
    except (ValueError, ValidationError) as exc:
        detail = exc.errors()[0] if isinstance(exc, ValidationError) else None
        where = ".".join(map(str, detail["loc"])) + ": " if detail else ""
        message = detail["msg"] if detail else "the body is not JSON"
        return _error(400, f"{where}{message}", "invalid_request_error")
    body: dict[str, Any] = {
        "model": ask.model,
        "messages": [{"role": "user", "content": ask.prompt}],
        "max_tokens": ask.max_tokens,
        "temperature": ask.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        return await forward(
            "chat/completions", body, session, viewer.principal, registry, settings, store
        )
    except TuneFleetError as exc:
        return _error(exc.status_code, exc.message, exc.code)
