"""A stand-in for Ray Serve that answers every chat request at once, for
``bench/api_load.py``'s inference phase: with no generation behind it, the API's own cost
per request (authentication, the model lookup, the inference limits, the relay) is the
whole of a request's time, so the limiter's share of it is the largest it can be.

    python -m uvicorn instant_serve:app --app-dir bench --port PORT
"""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

ANSWER = (
    b'{"id":"chatcmpl-0","object":"chat.completion","created":0,"model":"tiny-llama",'
    b'"choices":[{"index":0,"message":{"role":"assistant","content":"yo"},'
    b'"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,'
    b'"total_tokens":2}}'
)


async def chat(request: Request) -> Response:
    await request.body()
    return Response(ANSWER, media_type="application/json")


async def healthz(_: Request) -> Response:
    return Response(b'{"status":"ok"}', media_type="application/json")


app = Starlette(routes=[Route("/healthz", healthz), Route("/{path:path}", chat, methods=["POST"])])
