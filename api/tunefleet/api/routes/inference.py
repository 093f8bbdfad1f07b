"""``/v1/chat/completions`` and ``/v1/completions``: check the caller may use the model,
then forward the request to the Ray Serve application of its base model, naming the
adapter in the ``serve_multiplexed_model_id`` header so Serve routes it to a replica that
holds it. Streamed answers (``stream: true``) are relayed event by event."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from sqlalchemy.orm import Session

from tunefleet.api.deps import PrincipalDep, RegistryDep, SessionDep, SettingsDep
from tunefleet.platform.errors import InvalidRequest, NotFound, Unavailable
from tunefleet.platform.models import ModelRegistry
from tunefleet.platform.serving import visible_adapter
from tunefleet.platform.settings import Settings
from tunefleet.platform.tenants import Principal

router = APIRouter(prefix="/v1", tags=["inference"])


@router.post("/chat/completions")
async def chat_completions(
    request: Request,
    session: SessionDep,
    principal: PrincipalDep,
    registry: RegistryDep,
    settings: SettingsDep,
) -> Response:
    return await _forward("chat/completions", request, session, principal, registry, settings)


@router.post("/completions")
async def completions(
    request: Request,
    session: SessionDep,
    principal: PrincipalDep,
    registry: RegistryDep,
    settings: SettingsDep,
) -> Response:
    return await _forward("completions", request, session, principal, registry, settings)


async def _forward(
    path: str,
    request: Request,
    session: Session,
    principal: Principal,
    registry: ModelRegistry,
    settings: Settings,
) -> Response:
    """Check ``model``, then pass the request to Serve and its answer back: whole, or
    as the server-sent events it streams."""
    try:
        body = json.loads(await request.body())
    except ValueError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
        raise InvalidRequest(
            f"the request body must be a JSON object with 'model' and "
            f"{'messages' if path.startswith('chat') else 'prompt'}; "
            f"got {kind.get(type(body), 'a number')}"
        )
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest(
            "'model' is required: a base model or a fine_tuned_model name", param="model"
        )
    if model in registry.names():
        base, adapter_id = model, ""
    else:
        adapter = visible_adapter(session, principal.tenant_id, model)
        if adapter is None:
            raise NotFound(
                f"the model {model!r} does not exist or you do not have access to "
                "it; list yours with GET /v1/models",
                param="model",
                code="model_not_found",
            )
        base, adapter_id = adapter.base_model, adapter.job_id
    session.close()  # a long generation must not hold a database connection
    url = f"{settings.serve_url}/models/{base}/v1/{path}"
    headers = {"serve_multiplexed_model_id": adapter_id} if adapter_id else {}
    client = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=5.0))
    try:
        resp = await client.send(
            client.build_request("POST", url, json=body, headers=headers), stream=True
        )
    except httpx.TransportError as exc:
        await client.aclose()
        raise Unavailable(
            f"serving for base model {base!r} is not reachable at "
            f"{settings.serve_url} ({type(exc).__name__}); is `tunefleet up` "
            "running?"
        ) from exc
    if resp.headers.get("content-type", "").startswith("text/event-stream"):

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            finally:
                await resp.aclose()
                await client.aclose()

        return StreamingResponse(relay(), media_type="text/event-stream")
    try:
        content = await resp.aread()
    finally:
        await resp.aclose()
        await client.aclose()
    if resp.status_code == 404 and b"error" not in content:
        raise Unavailable(
            f"serving for base model {base!r} is not deployed yet; it starts "
            "when the first adapter of that model is ready",
            param="model",
        )
    return Response(content, status_code=resp.status_code, media_type="application/json")
