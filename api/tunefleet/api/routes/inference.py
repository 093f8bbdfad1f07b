"""``/v1/chat/completions`` and ``/v1/completions``: check the caller may use the model,
then forward the request to the Ray Serve application of its base model, naming the
adapter in the header Serve routes on (the contract is ``tunefleet.platform.serving``'s),
so it reaches a replica that holds it. Streamed answers (``stream: true``) are relayed
event by event."""

from __future__ import annotations

import asyncio
import json
import weakref
from collections.abc import AsyncIterator
from typing import Any

import anyio.to_thread
import httpx
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from sqlalchemy.orm import Session

from tunefleet.api._deps import PrincipalDep, RegistryDep, SessionDep, SettingsDep, StoreDep
from tunefleet.api._openapi import errors, ok, rate_limited
from tunefleet.platform.artifacts import Store
from tunefleet.platform.errors import InvalidRequest, NotFound, Unavailable
from tunefleet.platform.inference_limits import Lease, Limits, admit, release
from tunefleet.platform.models import ModelRegistry
from tunefleet.platform.serving import visible_adapter, visible_checkpoint
from tunefleet.platform.serving_contract import (
    ADAPTER_HEADER,
    SECRET_HEADER,
    route_prefix,
    serve_secret,
)
from tunefleet.platform.settings import Settings
from tunefleet.platform.tenants import Principal

router = APIRouter(prefix="/v1", tags=["inference"])

# The body is forwarded to Serve as it came (Serve validates it), so FastAPI does not parse
# it; the document still says what to send.
_MODEL: dict[str, Any] = {"type": "string", "minLength": 1, "description": "A base or tuned model."}
_CHAT_BODY: dict[str, Any] = {
    "type": "object",
    "required": ["model", "messages"],
    "properties": {
        "model": _MODEL,
        "messages": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["role", "content"],
                "properties": {
                    "role": {"type": "string"},
                    "content": {
                        "anyOf": [
                            {"type": "string"},
                            {"type": "array", "items": {"type": "object"}},
                        ],
                        "description": "Text, or a list of parts of type 'text'.",
                    },
                },
            },
        },
        "stream": {"type": "boolean"},
        "max_completion_tokens": {"type": "integer", "minimum": 1},
        "response_format": {"type": "object", "description": "text, json_object, json_schema"},
        "logprobs": {"type": "boolean"},
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
    },
    "description": "OpenAI's chat request; docs/api.md lists every parameter's support.",
}
_COMPLETION_BODY: dict[str, Any] = {
    "type": "object",
    "required": ["model", "prompt"],
    "properties": {
        "model": _MODEL,
        "prompt": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "string"}},
                {"type": "array", "items": {"type": "integer"}},
                {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
            ]
        },
        "logprobs": {"type": "integer", "minimum": 0, "maximum": 5},
        "stream": {"type": "boolean"},
        "max_tokens": {"type": "integer", "minimum": 1},
    },
}
# Without Ray, or before a base model's first adapter is ready, serving answers 503; over
# the tenant's inference limits (platform/inference_limits.py), 429.
_ANSWERS = {
    **ok(
        {
            "content": {
                "application/json": {"schema": {"type": "object"}},
                "text/event-stream": {"schema": {"type": "string"}},
            }
        },
        "The completion from Serve (or its server-sent events with stream: true).",
    ),
    **errors(404, 503),
    **rate_limited(),
}


def _body(schema: dict[str, Any]) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


@router.post("/chat/completions", responses=_ANSWERS, openapi_extra=_body(_CHAT_BODY))
async def chat_completions(
    request: Request,
    session: SessionDep,
    principal: PrincipalDep,
    registry: RegistryDep,
    settings: SettingsDep,
    store: StoreDep,
) -> Response:
    body = await _json_body("chat/completions", request)
    return await forward("chat/completions", body, session, principal, registry, settings, store)


@router.post("/completions", responses=_ANSWERS, openapi_extra=_body(_COMPLETION_BODY))
async def completions(
    request: Request,
    session: SessionDep,
    principal: PrincipalDep,
    registry: RegistryDep,
    settings: SettingsDep,
    store: StoreDep,
) -> Response:
    body = await _json_body("completions", request)
    return await forward("completions", body, session, principal, registry, settings, store)


# One connection pool to Serve per event loop (an API worker runs one): a request reuses
# open connections instead of making a client (and its TLS context) of its own. Keyed by
# loop because a client belongs to the loop it first ran on (tests' clients run a loop per
# request).
_CLIENTS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = (
    weakref.WeakKeyDictionary()
)
_LIMITS = httpx.Limits(max_connections=1024, max_keepalive_connections=64)


def serve_client() -> httpx.AsyncClient:
    loop = asyncio.get_running_loop()
    client = _CLIENTS.get(loop)
    if client is None or client.is_closed:
        timeout = httpx.Timeout(600.0, connect=5.0)
        client = _CLIENTS[loop] = httpx.AsyncClient(timeout=timeout, limits=_LIMITS)
    return client


async def close_serve_client() -> None:
    """At the app's shutdown: close this loop's connections to Serve."""
    client = _CLIENTS.pop(asyncio.get_running_loop(), None)
    if client is not None:
        await client.aclose()


def resolve_model(
    model: str,
    session: Session,
    principal: Principal,
    registry: ModelRegistry,
    store: Store,
) -> tuple[str, str]:
    """(base model, adapter id: '' for the bare base) of a model the caller may call: a
    base model, a fine-tuned model of its own or shared with it, or one of their
    checkpoints (``...:ckpt-step-N``)."""
    if model in registry.names():
        return model, ""
    adapter = visible_adapter(session, principal.tenant_id, model)
    if adapter is not None:
        return adapter.base_model, adapter.job_id
    checkpoint = visible_checkpoint(session, principal.tenant_id, model)
    if checkpoint is not None:
        if not store.exists(checkpoint.path):
            raise NotFound(
                f"the checkpoint {model!r} is no longer kept (a job keeps its newest "
                "checkpoints); list those with GET /v1/fine_tuning/jobs/{id}/checkpoints",
                param="model",
                code="model_not_found",
            )
        return checkpoint.base_model, checkpoint.adapter_id
    raise NotFound(
        f"the model {model!r} does not exist or you do not have access to it; list yours "
        "with GET /v1/models",
        param="model",
        code="model_not_found",
    )


async def _json_body(path: str, request: Request) -> dict[str, Any]:
    """The request's body: a JSON object, or 400 saying what it is instead."""
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
    return body


async def forward(
    path: str,
    body: dict[str, Any],
    session: Session,
    principal: Principal,
    registry: ModelRegistry,
    settings: Settings,
    store: Store,
) -> Response:
    """Check ``model``, then pass ``body`` to Serve (``path`` under its ``/v1``) and its
    answer back: whole, or as the server-sent events it streams. The REST routes and the
    dashboard's playground both call Serve through here."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest(
            "'model' is required: a base model or a fine_tuned_model name", param="model"
        )
    # a checkpoint's existence is a round trip to object storage: off the event loop
    base, adapter_id, lease = await anyio.to_thread.run_sync(
        _resolve_and_admit, model, session, principal, registry, store, settings
    )
    return await _send(path, body, base, adapter_id, settings, lease)


def _resolve_and_admit(
    model: str,
    session: Session,
    principal: Principal,
    registry: ModelRegistry,
    store: Store,
    settings: Settings,
) -> tuple[str, str, Lease | None]:
    """``_resolve``, then admission under the tenant's inference limits (or 429): a model
    the caller may not call is a 404 whatever its limits, and uses none of them."""
    base, adapter_id = resolve_model(model, session, principal, registry, store)
    session.close()  # a long generation must not hold a database connection
    lease = admit(
        settings.resolved_database_url,
        principal.tenant_id,
        principal.tenant_name,
        inference_limits(principal, settings),
    )
    return base, adapter_id, lease


def inference_limits(principal: Principal, settings: Settings) -> Limits:
    """The caller's tenant's limits: its own where an admin set them, else the defaults."""
    rate, slots = principal.inference_requests_per_s, principal.inference_concurrent_requests
    return Limits(
        settings.inference_requests_per_s if rate is None else rate,
        settings.inference_concurrent_requests if slots is None else slots,
    )


def _release(settings: Settings, lease: Lease | None) -> None:
    """Give the request's slot back (queued: no I/O here, see ``inference_limits``)."""
    if lease is not None:
        release(settings.resolved_database_url, lease)


async def _send(
    path: str,
    body: dict[str, Any],
    base: str,
    adapter_id: str,
    settings: Settings,
    lease: Lease | None,
) -> Response:
    """Serve's answer to ``body``. ``lease`` is released when the answer has ended: a
    streamed one when its relay ends, any other once read or failed."""
    url = f"{settings.serve_url}{route_prefix(base)}/v1/{path}"
    headers = {SECRET_HEADER: serve_secret(settings)}
    if adapter_id:
        headers[ADAPTER_HEADER] = adapter_id
    client = serve_client()
    try:
        resp = await client.send(
            client.build_request("POST", url, json=body, headers=headers), stream=True
        )
    except BaseException as exc:
        _release(settings, lease)
        if isinstance(exc, httpx.TransportError):
            raise Unavailable(
                f"serving for base model {base!r} is not reachable at "
                f"{settings.serve_url} ({type(exc).__name__}); is `tunefleet up` "
                "running?"
            ) from exc
        raise
    if resp.headers.get("content-type", "").startswith("text/event-stream"):

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            finally:
                await resp.aclose()
                _release(settings, lease)

        return StreamingResponse(relay(), media_type="text/event-stream")
    try:
        content = await resp.aread()
    finally:
        await resp.aclose()
        _release(settings, lease)
    if resp.status_code in (401, 403):  # Serve refused the API itself, not the caller
        raise Unavailable(
            f"serving for base model {base!r} refused the API's secret: set the same "
            "TUNEFLEET_SERVE_SECRET on the API and the controller"
        )
    if resp.status_code == 404 and b"error" not in content:
        raise Unavailable(
            f"serving for base model {base!r} is not deployed yet; it starts "
            "when the first adapter of that model is ready",
            param="model",
        )
    if resp.status_code >= 400 and not _is_error_object(content):
        # Serve's own proxy answers some failures (a replica that died mid-request, an
        # overload) in plain text: the client still gets an OpenAI error object
        raise Unavailable(
            f"serving for base model {base!r} failed: it answered {resp.status_code} "
            f"{content[:200].decode(errors='replace')!r}; try again, and if it persists "
            "see the serving replicas' logs"
        )
    return Response(content, status_code=resp.status_code, media_type="application/json")


def _is_error_object(content: bytes) -> bool:
    """Whether an answer is OpenAI's error shape, ``{"error": {...}}``."""
    try:
        body = json.loads(content)
    except ValueError:
        return False
    return isinstance(body, dict) and isinstance(body.get("error"), dict)
