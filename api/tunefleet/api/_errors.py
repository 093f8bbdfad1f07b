"""One place that turns errors into OpenAI's shape:
``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from sqlalchemy.exc import DataError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException

from tunefleet.platform.errors import RateLimited, TuneFleetError

log = logging.getLogger(__name__)

DATABASE_RETRY_AFTER_S = 2
# Answers a retry of the same request cannot change: a state conflict (the job is no
# longer pausable) and a quota. The OpenAI SDKs retry 409 and 429 on their own unless the
# answer says ``x-should-retry: false``, which they obey.
NOT_RETRYABLE = frozenset({409, 429})


def retry_headers(status: int, headers: Mapping[str, str] | None = None) -> dict[str, str] | None:
    """``headers`` (a ``Retry-After`` kept) plus ``x-should-retry: false`` for a status in
    NOT_RETRYABLE."""
    out = dict(headers or {})
    if status in NOT_RETRYABLE:
        out["x-should-retry"] = "false"
    return out or None


class RequestTooLarge(HTTPException):
    """413, raised while a request body is read (``tunefleet.api._body_limits``). A starlette
    ``HTTPException`` because FastAPI lets those through its body parsing, where any other
    exception becomes a 400 "There was an error parsing the body"."""

    def __init__(self, message: str, *, param: str | None, code: str) -> None:
        super().__init__(status_code=413, detail=message)
        self.message = message
        self.param = param
        self.code = code


def error_body(message: str, type_: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _got(error: Any) -> str:
    """`` (got 'x')`` naming the bad value, when it is a short scalar."""
    value = error.get("input")
    if error.get("type") == "missing" or not isinstance(value, str | int | float | bool):
        return ""
    shown = repr(value)
    return f" (got {shown})" if len(shown) <= 80 else f" (got {shown[:77]}...)"


def too_large_response(exc: RequestTooLarge) -> JSONResponse:
    return JSONResponse(
        status_code=413,
        content=error_body(exc.message, "invalid_request_error", exc.param, exc.code),
    )


def domain_error_response(exc: TuneFleetError) -> JSONResponse:
    headers: dict[str, str] | None
    if isinstance(exc, RateLimited):
        # the OpenAI SDKs wait retry-after-ms where given, else Retry-After (whole seconds)
        headers = {
            "Retry-After": str(max(1, math.ceil(exc.retry_after_s))),
            "retry-after-ms": str(max(1, math.ceil(exc.retry_after_s * 1000))),
        }
    else:
        headers = retry_headers(exc.status_code)
    return JSONResponse(
        status_code=exc.status_code,
        content=error_body(exc.message, exc.error_type, exc.param, exc.code),
        headers=headers,
    )


def database_unavailable_response(exc: Exception) -> JSONResponse:
    """503 with ``Retry-After``: the database is down, restarting, locked or out of
    connections, and a retry helps."""
    log.warning("database unavailable: %s", (str(exc).splitlines() or [""])[0][:300])
    return JSONResponse(
        status_code=503,
        content=error_body(
            "the database is unavailable for the moment; retry shortly",
            "server_error",
            None,
            "database_unavailable",
        ),
        headers={"Retry-After": str(DATABASE_RETRY_AFTER_S)},
    )


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(TuneFleetError)
    async def _domain(_: Request, exc: TuneFleetError) -> JSONResponse:
        return domain_error_response(exc)

    @app.exception_handler(RequestTooLarge)
    async def _too_large(_: Request, exc: RequestTooLarge) -> JSONResponse:
        return too_large_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _invalid(exc.errors())

    @app.exception_handler(ValidationError)
    async def _model_validation(_: Request, exc: ValidationError) -> JSONResponse:
        # a value the request carried, refused by a model the route builds from it
        return _invalid(exc.errors())

    @app.exception_handler(DataError)
    async def _refused_value(_: Request, exc: DataError) -> JSONResponse:
        # PostgreSQL refuses a value the request carried that no check before it caught
        # (a NUL character, a string over its column's length): the request's fault
        reason = (str(exc.orig).splitlines() or ["invalid value"])[0][:200]
        return JSONResponse(
            status_code=400,
            content=error_body(
                f"invalid request: a value in it cannot be stored or looked up ({reason}); "
                "ids and names hold no NUL characters and keep to their documented lengths",
                "invalid_request_error",
                None,
                "invalid_value",
            ),
        )

    @app.exception_handler(OperationalError)
    @app.exception_handler(PoolTimeout)
    async def _database(_: Request, exc: Exception) -> JSONResponse:
        return database_unavailable_response(exc)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        # starlette's own refusals: a body it cannot parse (400), a method (405)
        client = exc.status_code < 500
        return JSONResponse(
            status_code=exc.status_code,
            content=error_body(
                str(exc.detail),
                "invalid_request_error" if client else "server_error",
                None,
                "invalid_request" if client else "internal_error",
            ),
            headers=retry_headers(exc.status_code, exc.headers),
        )

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(
            status_code=500,
            content=error_body(
                f"internal error: {type(exc).__name__}", "server_error", None, "internal_error"
            ),
        )


def _invalid(errors: Any) -> JSONResponse:
    """400, as OpenAI answers a request its schema refuses (not FastAPI's 422, which the
    OpenAI SDKs do not raise as ``BadRequestError``): every refused field named, with the
    value it had."""
    errors = list(errors)
    first: dict[str, Any] = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":
        # FastAPI locates a JSON syntax error at ("body", character offset): not a field
        reason = (first.get("ctx") or {}).get("error", "invalid JSON")
        return JSONResponse(
            status_code=400,
            content=error_body(
                f"invalid request: the body is not valid JSON ({reason} at character "
                f"{first.get('loc', ('', '?'))[-1]}); send a JSON object",
                "invalid_request_error",
                None,
                "invalid_request",
            ),
        )
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path", "header")]
    param = ".".join(loc) or None
    detail = "; ".join(
        f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body')}: {e.get('msg')}" + _got(e)
        for e in errors[:10]
    )
    return JSONResponse(
        status_code=400,
        content=error_body(
            f"invalid request: {detail}", "invalid_request_error", param, "invalid_request"
        ),
    )
