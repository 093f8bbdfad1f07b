"""Eval runs (``/v1/evals/{id}/runs``) through the official SDK's ``client.evals.runs``,
run by the controller's eval step (``workers/_evals.py``) on a real database.

Serving here is a stand-in (a unit test's fake: it answers chat as a base model and as an
adapter would, by the header Serve routes on); the real serving path is
``tests/e2e/test_thin_path.py``'s eval test. What is checked: a run's items are sampled
through the serving path with the adapter named, graded by every criterion, counted in
OpenAI's shapes and paged; a run taken up again after a crash samples only what was not
written, and writes no item twice; a serving outage retries the run, an item serving
refuses is an error item; cancel stops it; bad data is a 400 naming the item and nothing
is kept."""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient
from openai import OpenAI
from sqlalchemy import func, select
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tunefleet.api import create_app
from tunefleet.platform.db import EvalOutputItem, EvalRun, session_scope
from tunefleet.platform.ids import new_id
from tunefleet.platform.serving_contract import ADAPTER_HEADER
from tunefleet.platform.settings import Settings
from tunefleet.workers._evals import EvalRuns

CAPITALS = {"France": "Paris", "Peru": "Lima", "Japan": "Tokyo", "Kenya": "Nairobi"}
ITEMS = [{"item": {"country": c, "answer": a}} for c, a in CAPITALS.items()]
SCHEMA = {
    "type": "object",
    "properties": {"country": {"type": "string"}, "answer": {"type": "string"}},
    "required": ["country", "answer"],
}
EXACT = {
    "type": "string_check",
    "name": "exact",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "eq",
}
CLOSE = {
    "type": "text_similarity",
    "name": "close",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "evaluation_metric": "fuzzy_match",
    "pass_threshold": 0.5,
}
TEMPLATE = {
    "type": "template",
    "template": [
        {"role": "system", "content": "Answer with the city only."},
        {"role": "user", "content": "The capital of {{item.country}}?"},
    ],
}


class StandInServe:
    """Serve's place: a request naming an adapter is answered with the capital, the bare
    base with the capital's first three letters (a fuzzy pass, an exact fail); "Narnia"
    is refused as serving refuses a bad item (a 400 error object); while ``down`` is
    above 0 a request gets a 503 (a replica restarting). Every request is kept."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.down = 0
        self.lock = threading.Lock()

    def app(self) -> Starlette:
        async def chat(request: Request) -> Response:
            body = await request.json()
            with self.lock:
                if self.down > 0:
                    self.down -= 1
                    return Response("replica restarting", status_code=503)
                self.seen.append({"body": body, "adapter": request.headers.get(ADAPTER_HEADER)})
            country = body["messages"][-1]["content"].removeprefix("The capital of ")[:-1]
            if country == "Narnia":
                error = {"message": "no such place", "code": "invalid_messages", "type": "x"}
                return JSONResponse({"error": error}, status_code=400)
            city = CAPITALS[country]
            text = city if request.headers.get(ADAPTER_HEADER) else city[:3]
            return JSONResponse(
                {
                    "id": "chatcmpl-1",
                    "object": "chat.completion",
                    "model": body["model"],
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": text},
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9},
                }
            )

        async def alive(_: Request) -> JSONResponse:
            return JSONResponse({"status": "ok"})

        return Starlette(
            routes=[Route("/healthz", alive), Route("/{path:path}", chat, methods=["POST"])]
        )


@pytest.fixture
def stack(
    settings: Settings, live_server: Callable[..., str], a_objects: dict[str, Any], key_a: str
) -> Iterator[dict[str, Any]]:
    """The API (TestClient), tenant A's SDK, the stand-in Serve, and the controller's eval
    step on the same database: ``runner.run()`` is one pass."""
    serve = StandInServe()
    host, port = live_server(serve.app()).removeprefix("http://").split(":")
    with_serve = settings.model_copy(update={"serve_host": host, "serve_port": int(port)})
    url = settings.resolved_database_url
    runner = EvalRuns(with_serve, url, lambda: session_scope(url), lambda base: True)
    with TestClient(create_app(settings)) as client:
        yield {
            "client": client,
            "serve": serve,
            "runner": runner,
            "url": url,
            "model": a_objects["model"],
            "sdk": OpenAI(
                base_url="http://testserver/v1",
                api_key=key_a,
                http_client=client,
                max_retries=0,
            ),
        }
    runner.close()
    runner.wait(30)


def _eval(sdk: OpenAI) -> Any:
    return sdk.evals.create(
        name="capitals",
        data_source_config={"type": "custom", "item_schema": SCHEMA, "include_sample_schema": True},
        testing_criteria=[EXACT, CLOSE],  # type: ignore[list-item]
    )


def _completions(model: str, content: list[dict[str, Any]] = ITEMS, **more: Any) -> Any:
    return {
        "type": "completions",
        "model": model,
        "input_messages": TEMPLATE,
        "source": {"type": "file_content", "content": content},
        "sampling_params": {"temperature": 0, "max_completion_tokens": 8},
        **more,
    }


def _finish(runner: EvalRuns, sdk: OpenAI, eval_id: str, run_id: str, timeout: float = 60) -> Any:
    """Passes of the eval step until the run has ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runner.run()
        runner.wait(30)
        run = sdk.evals.runs.retrieve(run_id, eval_id=eval_id)
        if run.status not in ("queued", "in_progress"):
            return run
        time.sleep(0.2)
    raise AssertionError(f"run {run_id} did not end: {run.status}")


def _items(sdk: OpenAI, eval_id: str, run_id: str, **query: Any) -> list[Any]:
    pages = sdk.evals.runs.output_items.list(run_id, eval_id=eval_id, limit=3, **query)
    return list(pages)  # the SDK pages on after= until has_more is false


def test_a_run_samples_each_item_through_serving_grades_counts_and_pages_it(
    stack: dict[str, Any],
) -> None:
    sdk, serve = stack["sdk"], stack["serve"]
    made = _eval(sdk)
    tuned = sdk.evals.runs.create(made.id, name="tuned", data_source=_completions(stack["model"]))
    base = sdk.evals.runs.create(made.id, name="base", data_source=_completions("tiny-llama"))
    assert tuned.status == "queued" and tuned.object == "eval.run"
    assert tuned.result_counts.total == 4 and tuned.model == stack["model"]

    tuned, base = (_finish(stack["runner"], sdk, made.id, r.id) for r in (tuned, base))
    assert tuned.status == base.status == "completed"
    # the adapter answers each capital: both criteria pass on all four
    assert tuned.result_counts.model_dump() == {"total": 4, "passed": 4, "failed": 0, "errored": 0}
    # the base gives three letters: fuzzy_match ("Par" against "Paris" is 0.75) passes, eq
    # fails
    assert base.result_counts.model_dump() == {"total": 4, "passed": 0, "failed": 4, "errored": 0}
    per = {r.testing_criteria: (r.passed, r.failed) for r in base.per_testing_criteria_results}
    assert per == {"exact": (0, 4), "close": (4, 0)}
    usage = tuned.per_model_usage[0]
    assert (usage.model_name, usage.invocation_count, usage.total_tokens) == (stack["model"], 4, 36)

    # serving saw the rendered template, the sampling params and the adapter's header
    adapter_ids = {s["adapter"] for s in serve.seen}
    assert len(adapter_ids) == 2 and None in adapter_ids
    asked = next(s["body"] for s in serve.seen if s["body"]["model"] == stack["model"])
    assert asked["messages"][0] == {"role": "system", "content": "Answer with the city only."}
    assert asked["temperature"] == 0 and asked["max_completion_tokens"] == 8
    assert len(serve.seen) == 8  # one request per item and model, none repeated

    items = _items(sdk, made.id, base.id)
    assert [i.datasource_item_id for i in items] == [0, 1, 2, 3]
    first = items[0]
    assert first.status == "fail" and first.datasource_item == ITEMS[0]["item"]
    assert first.sample.output[0].content == "Par" and first.sample.usage.total_tokens == 9
    assert first.sample.input[1].content == "The capital of France?"
    scores = {r.name: (r.score, r.passed) for r in first.results}
    assert scores == {"exact": (0.0, False), "close": (0.75, True)}
    assert _items(sdk, made.id, base.id, status="pass") == []
    assert len(_items(sdk, made.id, tuned.id, status="pass")) == 4
    desc = [i.datasource_item_id for i in _items(sdk, made.id, tuned.id, order="desc")]
    assert desc == [3, 2, 1, 0]
    got = sdk.evals.runs.output_items.retrieve(first.id, eval_id=made.id, run_id=base.id)
    assert got.model_dump() == first.model_dump()
    listed = [r.id for r in sdk.evals.runs.list(made.id)]
    assert listed == [tuned.id, base.id]
    assert [r.id for r in sdk.evals.runs.list(made.id, status="completed", order="desc")] == [
        base.id,
        tuned.id,
    ]


def test_a_run_taken_up_after_a_crash_samples_only_the_items_not_yet_written(
    stack: dict[str, Any],
) -> None:
    """A leader wrote items 0 and 1 and died: the next samples 2 and 3 only, and a write of
    an item already there (a deposed leader's late one) is dropped, not doubled."""
    sdk, serve, url = stack["sdk"], stack["serve"], stack["url"]
    made = _eval(sdk)
    run = sdk.evals.runs.create(made.id, data_source=_completions(stack["model"]))
    kept = {}
    with session_scope(url) as s:
        s.get(EvalRun, run.id).status = "in_progress"  # type: ignore[union-attr]
        for index in (0, 1):
            kept[index] = new_id("output_item")
            s.add(
                EvalOutputItem(
                    id=kept[index],
                    run_id=run.id,
                    item_index=index,
                    status="pass",
                    datasource_item=ITEMS[index]["item"],
                    sample=None,
                    results=[{"name": "exact", "passed": True, "score": 1.0}],
                    created_ns=time.time_ns(),
                )
            )
    done = _finish(stack["runner"], sdk, made.id, run.id)
    assert done.status == "completed" and done.result_counts.total == 4
    asked = [s["body"]["messages"][-1]["content"] for s in serve.seen]
    assert sorted(asked) == ["The capital of Japan?", "The capital of Kenya?"]
    items = _items(sdk, made.id, run.id)
    assert [i.datasource_item_id for i in items] == [0, 1, 2, 3]
    assert [items[0].id, items[1].id] == [kept[0], kept[1]]

    # a second take of a finished item (what a deposed leader's thread would write)
    stack["runner"]._item(_job(url, run.id), [], None, None, 2)  # type: ignore[arg-type]
    with session_scope(url) as s:
        rows = s.scalar(select(func.count()).where(EvalOutputItem.run_id == run.id))
    assert rows == 4


def _job(url: str, run_id: str) -> Any:
    from tunefleet.workers._evals import _RunJob

    with session_scope(url) as s:
        run = s.get(EvalRun, run_id)
        assert run is not None
        run.status = "in_progress"  # as it was while the deposed leader ran it
        return _RunJob(
            run_id=run_id,
            items=[{"item": {"country": "Japan", "answer": "Tokyo"}, "sample": {}}] * 3,
            data_source=run.data_source,
            model=run.model,
            base="",
            adapter_id="",
            stored=[],
        )


def test_a_serving_outage_retries_the_run_and_an_item_serving_refuses_is_an_error(
    stack: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("tunefleet.workers._evals.RETRY_S", 0.2)
    sdk, serve = stack["sdk"], stack["serve"]
    made = _eval(sdk)
    narnia = {"item": {"country": "Narnia", "answer": "Cair Paravel"}}
    serve.down = 3
    run = sdk.evals.runs.create(made.id, data_source=_completions(stack["model"], [*ITEMS, narnia]))
    done = _finish(stack["runner"], sdk, made.id, run.id)
    assert done.status == "completed"
    assert done.result_counts.model_dump() == {"total": 5, "passed": 4, "failed": 0, "errored": 1}
    assert len(serve.seen) == 5  # the 503s wrote nothing; each item was answered once
    (error,) = _items(sdk, made.id, run.id, status="error")
    assert error.datasource_item_id == 4 and error.results == []
    assert error.sample.error.code == "invalid_messages"
    assert error.sample.error.message == "no such place"


def test_a_jsonl_run_grades_the_samples_it_is_given(stack: dict[str, Any]) -> None:
    sdk = stack["sdk"]
    made = _eval(sdk)
    rows = [
        {"item": {"country": "Peru", "answer": "Lima"}, "sample": {"output_text": "Lima"}},
        {
            "item": {"country": "Japan", "answer": "Tokyo"},
            "sample": {"choices": [{"message": {"role": "assistant", "content": "Kyoto"}}]},
        },
    ]
    upload = sdk.files.create(
        file=("items.jsonl", io.BytesIO("\n".join(map(json.dumps, rows)).encode())),
        purpose="evals",
    )
    run = sdk.evals.runs.create(
        made.id, data_source={"type": "jsonl", "source": {"type": "file_id", "id": upload.id}}
    )
    done = _finish(stack["runner"], sdk, made.id, run.id)
    assert done.result_counts.model_dump() == {"total": 2, "passed": 1, "failed": 1, "errored": 0}
    assert stack["serve"].seen == []  # nothing generated
    # "Kyoto" against "Tokyo": their longest common subsequence is 2 of 5 + 5 characters
    # (case counts), so rapidfuzz's ratio is 2 * 2 / 10 = 0.4, a fuzzy fail at 0.5
    second = _items(sdk, made.id, run.id)[1]
    assert second.status == "fail"
    assert {r.name: (r.score, r.passed) for r in second.results} == {
        "exact": (0.0, False),
        "close": (pytest.approx(0.4), False),
    }


def test_a_cancelled_run_samples_no_more_and_an_ended_one_cannot_be_cancelled(
    stack: dict[str, Any],
) -> None:
    sdk, serve = stack["sdk"], stack["serve"]
    made = _eval(sdk)
    run = sdk.evals.runs.create(made.id, data_source=_completions(stack["model"]))
    cancelled = sdk.evals.runs.cancel(run.id, eval_id=made.id)
    assert cancelled.status == "canceled"
    stack["runner"].run()
    stack["runner"].wait(30)
    assert serve.seen == [] and _items(sdk, made.id, run.id) == []
    with pytest.raises(openai.ConflictError, match="already canceled"):
        sdk.evals.runs.cancel(run.id, eval_id=made.id)
    gone = sdk.evals.runs.delete(run.id, eval_id=made.id)
    assert gone.deleted is True and gone.run_id == run.id
    with pytest.raises(openai.NotFoundError, match=run.id):
        sdk.evals.runs.retrieve(run.id, eval_id=made.id)


@pytest.mark.parametrize(
    ("source", "match"),
    [
        (
            [{"item": {"country": "France"}}],
            r"data_source.source item 0 does not match the eval's item_schema: at its top "
            r"level, 'answer' is a required property",
        ),
        ([{"question": "x"}], r'item 0: each item is an object \{"item"'),
        (
            [{"item": {"country": "France", "answer": "Paris"}, "extra": 1}],
            r"item 0: unknown keys \['extra'\]",
        ),
    ],
)
def test_bad_items_are_refused_naming_the_item_and_nothing_is_kept(
    stack: dict[str, Any], source: list[Any], match: str
) -> None:
    sdk = stack["sdk"]
    made = _eval(sdk)
    with pytest.raises(openai.BadRequestError, match=match):
        sdk.evals.runs.create(made.id, data_source=_completions(stack["model"], source))
    assert list(sdk.evals.runs.list(made.id)) == []


def test_unknown_models_templates_and_files_are_refused_by_name(stack: dict[str, Any]) -> None:
    sdk = stack["sdk"]
    made = _eval(sdk)
    with pytest.raises(openai.NotFoundError, match="the model 'ft:nope' does not exist"):
        sdk.evals.runs.create(made.id, data_source=_completions("ft:nope"))
    bad = {"type": "template", "template": [{"role": "user", "content": "{{item.city}}"}]}
    with pytest.raises(openai.BadRequestError, match=r"input_messages on item 0: \{\{item.city"):
        sdk.evals.runs.create(made.id, data_source=_completions("tiny-llama", input_messages=bad))
    training = stack["client"].get("/v1/files", headers=sdk.auth_headers).json()["data"][0]
    source = {"type": "file_id", "id": training["id"]}
    with pytest.raises(openai.BadRequestError, match="has purpose 'fine-tune'"):
        sdk.evals.runs.create(made.id, data_source={"type": "jsonl", "source": source})
    with pytest.raises(openai.BadRequestError, match=r"evals file: item 1 is not"):
        sdk.files.create(file=("x.jsonl", io.BytesIO(b'{"q": 1}\n')), purpose="evals")
    assert list(sdk.evals.runs.list(made.id)) == []
