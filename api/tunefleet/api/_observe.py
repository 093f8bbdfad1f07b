"""Request metrics of the API (``tunefleet.platform.metrics``): every request counted and
timed by its route template (``/v1/fine_tuning/jobs/{job_id}``, never the id: bounded
label values), as an ASGI middleware that sees streamed answers to their end."""

from __future__ import annotations

import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tunefleet.platform.metrics import API_REQUESTS, API_SECONDS


class RequestMetrics:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # what a request that raised past every handler became

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            API_REQUESTS.labels(scope["method"], route, str(status)).inc()
            API_SECONDS.labels(scope["method"], route).observe(time.perf_counter() - started)
