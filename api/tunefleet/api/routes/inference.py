"""``/v1/chat/completions``: checks the caller may use the model, then forwards the request
to the Ray Serve application of its base model, naming the adapter in the
``serve_multiplexed_model_id`` header so Serve routes it to a replica that holds it."""

from __future__ import annotations

from typing import Any

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sqlalchemy import select

from tunefleet.api.deps import PrincipalDep, RegistryDep, SessionDep, SettingsDep
from tunefleet.platform.db import Adapter
from tunefleet.platform.errors import InvalidRequest, NotFound, Unavailable

router = APIRouter(prefix="/v1", tags=["inference"])


@router.post("/chat/completions")
async def chat_completions(
    request: Request,
    session: SessionDep,
    principal: PrincipalDep,
    registry: RegistryDep,
    settings: SettingsDep,
) -> JSONResponse:
    body: dict[str, Any] = await request.json()
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest(
            "'model' is required: a base model or a fine_tuned_model name", param="model"
        )
    if body.get("stream"):
        raise InvalidRequest(
            "streaming is not supported yet; send stream=false", param="stream", code="unsupported"
        )
    if model in registry.names():
        base, adapter_id = model, ""
    else:
        adapter = session.scalar(
            select(Adapter).where(Adapter.name == model, Adapter.tenant_id == principal.tenant_id)
        )
        if adapter is None:
            raise NotFound(
                f"the model {model!r} does not exist or you do not have access to "
                "it; list yours with GET /v1/models",
                param="model",
                code="model_not_found",
            )
        base, adapter_id = adapter.base_model, adapter.job_id
    url = f"{settings.serve_url}/models/{base}/v1/chat/completions"
    headers = {"serve_multiplexed_model_id": adapter_id} if adapter_id else {}
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=5.0)) as client:
            resp = await client.post(url, json=body, headers=headers)
    except httpx.TransportError as exc:
        raise Unavailable(
            f"serving for base model {base!r} is not reachable at "
            f"{settings.serve_url} ({type(exc).__name__}); is `tunefleet up` "
            "running?"
        ) from exc
    if resp.status_code == 404 and "error" not in resp.text:
        raise Unavailable(
            f"serving for base model {base!r} is not deployed yet; it starts "
            "when the first adapter of that model is ready",
            param="model",
        )
    return JSONResponse(status_code=resp.status_code, content=resp.json())
