"""The bounds on what one serving request may cost a replica (docs/serving.md "Bounds",
docs/reliability.md), at each limit and one past it: 2048 messages, `stop` strings of 256
characters, 128 choices. A request is read by ``_openai_api.parse`` and its rows counted by
``LoraServer._refusal``, both before any row joins the shared batch; a refusal is a 400 in
OpenAI's shape naming the parameter and the limit. (tests/e2e/test_thin_path.py sends such
requests to a real replica beside good ones.)"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.responses import JSONResponse

from tunefleet.workers.serve._openai_api import (
    MAX_MESSAGES,
    MAX_ROWS_PER_REQUEST,
    MAX_STOP,
    MAX_STOP_CHARS,
    ChatRequest,
    CompletionRequest,
    parse,
)

HI = {"role": "user", "content": "hi"}


class Body:
    """What ``parse`` reads of a request: its body."""

    def __init__(self, payload: dict[str, Any]) -> None:
        self.payload = json.dumps(payload).encode()

    async def body(self) -> bytes:
        return self.payload


def _parse(model: type[Any], payload: dict[str, Any]) -> Any:
    return asyncio.run(parse(model, Body(payload)))  # type: ignore[arg-type]


def _refused(answer: Any) -> dict[str, Any]:
    assert isinstance(answer, JSONResponse), answer
    assert answer.status_code == 400
    error: dict[str, Any] = json.loads(bytes(answer.body))["error"]
    assert error["type"] == "invalid_request_error"
    return error


def test_the_bounds_are_the_documented_ones() -> None:
    assert (MAX_MESSAGES, MAX_STOP, MAX_STOP_CHARS, MAX_ROWS_PER_REQUEST) == (2048, 4, 256, 128)


def test_2048_messages_are_read_and_2049_refused_naming_the_count() -> None:
    ok = _parse(ChatRequest, {"model": "m", "messages": [HI] * 2048})
    assert isinstance(ok, ChatRequest) and len(ok.template_messages()) == 2048
    error = _refused(_parse(ChatRequest, {"model": "m", "messages": [HI] * 2049}))
    assert (error["param"], error["code"]) == ("messages", "invalid_request")
    said = "messages: List should have at most 2048 items after validation, not 2049"
    assert said in error["message"]


@pytest.mark.parametrize("model", [ChatRequest, CompletionRequest])
def test_stop_strings_of_256_characters_are_read_and_257_refused(model: type[Any]) -> None:
    base: dict[str, Any] = {"model": "m"} | (
        {"messages": [HI]} if model is ChatRequest else {"prompt": "hi"}
    )
    at, past = "s" * 256, "s" * 257
    ok = _parse(model, {**base, "stop": at})
    assert isinstance(ok, model) and ok.sampling(8, 0).stop == (at,)
    ok = _parse(model, {**base, "stop": [at, "b", "c", at]})
    assert isinstance(ok, model) and ok.sampling(8, 0).stop == (at, "b", "c", at)
    for stop, where in (
        (past, "stop.constrained-str"),
        (["b", past], "stop.list[constrained-str].1"),
    ):
        error = _refused(_parse(model, {**base, "stop": stop}))
        assert (error["param"], error["code"]) == ("stop", "invalid_request")
        assert f"{where}: String should have at most 256 characters" in error["message"]


def test_128_choices_are_served_and_129_refused_naming_the_count() -> None:
    """Choices = prompts x choices per prompt (``n``, or ``best_of`` when larger)."""
    from tunefleet.workers.serve.app import LoraServer

    replica = SimpleNamespace(context=512)  # what _refusal reads of the replica
    refusal = LoraServer.func_or_class._refusal

    def rows(prompts: int, **asked: int) -> Any:
        req = _parse(CompletionRequest, {"model": "m", "prompt": ["a"] * prompts, **asked})
        assert isinstance(req, CompletionRequest)
        return refusal(replica, req, [[1]] * prompts, 4, chat=False)

    assert rows(1, n=128) is None and rows(8, n=16) is None
    assert rows(64, best_of=2) is None
    for prompts, asked, per in ((3, {"n": 43}, 43), (43, {"n": 1, "best_of": 3}, 3)):
        error = _refused(rows(prompts, **asked))
        assert (error["param"], error["code"]) == ("n", "too_many_choices")
        assert error["message"] == (
            f"{prompts} prompt(s) x {per} choice(s) is 129 choices; at most 128 per request"
        )
