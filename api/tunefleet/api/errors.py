"""One place that turns errors into OpenAI's shape:
``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException

from tunefleet.platform.errors import TuneFleetError

log = logging.getLogger(__name__)

DATABASE_RETRY_AFTER_S = 2


def error_body(message: str, type_: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _got(error: Any) -> str:
    """`` (got 'x')`` naming the bad value, when it is a short scalar."""
    value = error.get("input")
    if error.get("type") == "missing" or not isinstance(value, str | int | float | bool):
        return ""
    shown = repr(value)
    return f" (got {shown})" if len(shown) <= 80 else f" (got {shown[:77]}...)"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(TuneFleetError)
    async def _domain(_: Request, exc: TuneFleetError) -> JSONResponse:
        return JSONResponse(
            status_code=exc.status_code,
            content=error_body(exc.message, exc.error_type, exc.param, exc.code),
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _invalid(exc.errors())

    @app.exception_handler(ValidationError)
    async def _model_validation(_: Request, exc: ValidationError) -> JSONResponse:
        # a value the request carried, refused by a model the route builds from it
        return _invalid(exc.errors())

    @app.exception_handler(OperationalError)
    @app.exception_handler(PoolTimeout)
    async def _database(_: Request, exc: Exception) -> JSONResponse:
        # the database is down, restarting, locked or out of connections: a retry helps
        log.warning("database unavailable: %s", str(exc).splitlines()[0][:300])
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

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(
            status_code=exc.status_code,
            content=error_body(str(exc.detail), type_, None, None),
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
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
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
