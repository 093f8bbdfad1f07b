"""Request bodies: authenticated before they are read, bounded while they are read.

FastAPI reads a route's whole body (a JSON document, or a multipart upload spooled to
disk) before it solves the route's dependencies, so neither the API-key dependency nor a
size check in a handler can stop a large body: both run after it was read. This ASGI
middleware sits in front of the app and, for a method that carries a body (POST, PUT,
PATCH):

1. authenticates the caller from the headers alone, for paths under ``/v1/``: a missing,
   unknown or revoked key is a 401 before one byte of the body is read. The principal is
   left in the scope for ``deps.get_principal``, so a request is authenticated once;
2. refuses a declared ``content-length`` over the route's limit at once (413);
3. counts the bytes as the app pulls them from ``receive`` and raises ``RequestTooLarge``
   (413) as soon as they pass the limit: a chunked body declares no length, and a client
   may declare less than it sends.

Limits, from the settings: an upload (``POST /v1/files``) ``max_upload_bytes`` plus room
for the multipart envelope; chat and completions ``max_inference_body_bytes``; every other
route ``max_json_body_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tunefleet.api._deps import PRINCIPAL_SCOPE_KEY, principal_for
from tunefleet.api._errors import (
    RequestTooLarge,
    database_unavailable_response,
    domain_error_response,
    too_large_response,
)
from tunefleet.platform.errors import TuneFleetError
from tunefleet.platform.settings import Settings

BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
UPLOAD_PATH = "/v1/files"
INFERENCE_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
# The multipart envelope around an uploaded file: boundaries, part headers, the purpose
# field. The file part itself is held to max_upload_bytes as it is stored.
MULTIPART_ALLOWANCE = 64 * 1024


@dataclass(frozen=True)
class BodyLimit:
    """The most body bytes a route reads, and the 413 that names it and its setting."""

    max_bytes: int
    message: str
    param: str | None
    code: str

    def error(self) -> RequestTooLarge:
        return RequestTooLarge(self.message, param=self.param, code=self.code)


def body_limit(settings: Settings, method: str, path: str) -> BodyLimit:
    if path.rstrip("/") == UPLOAD_PATH:
        return BodyLimit(
            settings.max_upload_bytes + MULTIPART_ALLOWANCE,
            f"upload exceeds the limit of {settings.max_upload_bytes} bytes; split the file "
            "or raise TUNEFLEET_MAX_UPLOAD_BYTES",
            "file",
            "file_too_large",
        )
    if path in INFERENCE_PATHS:
        limit, setting = settings.max_inference_body_bytes, "TUNEFLEET_MAX_INFERENCE_BODY_BYTES"
    else:
        limit, setting = settings.max_json_body_bytes, "TUNEFLEET_MAX_JSON_BODY_BYTES"
    return BodyLimit(
        limit,
        f"the body of {method} {path} exceeds the limit of {limit} bytes; send less "
        f"(fewer or shorter fields) or raise {setting}",
        None,
        "request_too_large",
    )


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        path: str = scope["path"]
        if path.startswith("/v1/"):
            try:
                scope[PRINCIPAL_SCOPE_KEY] = principal_for(
                    self.settings, headers.get("authorization")
                )
            except TuneFleetError as exc:
                await domain_error_response(exc)(scope, receive, send)
                return
            except (OperationalError, PoolTimeout) as exc:
                await database_unavailable_response(exc)(scope, receive, send)
                return
        limit = body_limit(self.settings, scope["method"], path)
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit.max_bytes:
            await too_large_response(limit.error())(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit.max_bytes:
                    raise limit.error()
            return message

        await self.app(scope, counting_receive, send)
