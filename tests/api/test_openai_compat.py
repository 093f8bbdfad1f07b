"""OpenAI's behaviours the official SDK relies on, driven through the SDK (in-process, over
the ASGI app) with its default retries: answers it must not retry, cursor pagination that
visits every object once and ends, model deletion, and the fields it reads."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from openai import OpenAI
from sqlalchemy import select, update

from conftest import CHAT, TINY, upload_chat
from conftest import auth as H
from tunefleet.api import create_app
from tunefleet.api._errors import retry_headers
from tunefleet.platform.artifacts import artifact_store
from tunefleet.platform.db import Adapter, AdapterShare, Checkpoint, Job, session_scope
from tunefleet.platform.ids import new_id
from tunefleet.platform.serving import serving_config
from tunefleet.platform.settings import Settings


@pytest.fixture
def sent(app_client: TestClient) -> Iterator[list[httpx.Request]]:
    """Every request the test client sends, as the server receives it (retries too)."""
    requests: list[httpx.Request] = []
    app_client.event_hooks["request"].append(requests.append)
    yield requests


@pytest.fixture
def sdk(app_client: TestClient, key_a: str) -> OpenAI:
    """The SDK as users make it: its default retries (2) are on."""
    client = OpenAI(base_url="http://testserver/v1", api_key=key_a, http_client=app_client)
    assert client.max_retries == 2
    return client


def _upload(sdk: OpenAI, name: str = "t.jsonl") -> str:
    data = (json.dumps(CHAT) + "\n").encode()
    return sdk.files.create(file=(name, data), purpose="fine-tune").id


def test_conflicts_and_quota_refusals_are_not_retried(
    sdk: OpenAI, sent: list[httpx.Request]
) -> None:
    job = sdk.fine_tuning.jobs.create(model=TINY, training_file=_upload(sdk))
    assert job.status == "validating_files"
    sent.clear()
    with pytest.raises(openai.ConflictError, match="validating_files") as conflict:
        sdk.fine_tuning.jobs.pause(job.id)
    assert conflict.value.response.headers["x-should-retry"] == "false"
    assert [r.url.path for r in sent] == [f"/v1/fine_tuning/jobs/{job.id}/pause"]

    sent.clear()
    with pytest.raises(openai.RateLimitError, match="max_gpus") as quota:
        sdk.fine_tuning.jobs.create(
            model=TINY,
            training_file=job.training_file,
            extra_body={"tunefleet": {"resources": {"num_workers": 2, "gpus_per_worker": 8}}},
        )
    assert quota.value.response.headers["x-should-retry"] == "false"
    assert len(sent) == 1


def test_retry_headers_keep_a_retry_after() -> None:
    assert retry_headers(429, {"Retry-After": "3"}) == {
        "Retry-After": "3",
        "x-should-retry": "false",
    }
    assert retry_headers(409) == {"x-should-retry": "false"}
    assert retry_headers(503, {"Retry-After": "2"}) == {"Retry-After": "2"}
    assert retry_headers(404) is None


def test_files_list_pages_by_cursor(
    sdk: OpenAI, app_client: TestClient, key_a: str, key_b: str
) -> None:
    made = [_upload(sdk, f"f{i}.jsonl") for i in range(5)]
    theirs = upload_chat(app_client, key_b)["id"]
    everything = list(sdk.files.list())
    assert sorted(f.id for f in everything) == sorted(made)
    newest_first = [f.id for f in everything]
    # created_at is whole seconds: the id orders files of one second
    assert [(f.created_at, f.id) for f in everything] == sorted(
        ((f.created_at, f.id) for f in everything), reverse=True
    )

    page = sdk.files.list(limit=2)
    assert [f.id for f in page.data] == newest_first[:2] and page.has_more
    # auto-pagination follows `after` and stops at has_more false: each file once
    assert [f.id for f in itertools.islice(sdk.files.list(limit=2), 20)] == newest_first
    assert [f.id for f in sdk.files.list(limit=2, order="asc")] == newest_first[::-1]
    last = sdk.files.list(limit=3, after=newest_first[1])
    assert [f.id for f in last.data] == newest_first[2:] and not last.has_more
    assert [f.id for f in sdk.files.list(purpose="fine-tune", limit=10)] == newest_first
    assert list(sdk.files.list(purpose="assistants")) == []

    for cursor in ("file-missing", theirs):  # another tenant's file is no cursor either
        with pytest.raises(openai.NotFoundError, match=repr(cursor)) as missing:
            sdk.files.list(after=cursor)
        assert missing.value.body["param"] == "after"  # type: ignore[index]
    for limit in (0, 10_001):
        resp = app_client.get(f"/v1/files?limit={limit}", headers=H(key_a))
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "limit"
    resp = app_client.get("/v1/files?order=newest", headers=H(key_a))
    assert resp.status_code == 400 and "'newest'" in resp.json()["error"]["message"]


def test_checkpoints_list_pages_by_cursor(sdk: OpenAI, settings: Settings) -> None:
    job = sdk.fine_tuning.jobs.create(model=TINY, training_file=_upload(sdk))
    store = artifact_store(settings)
    with session_scope(settings.resolved_database_url) as s:
        for step in range(1, 7):
            path = f"{store.checkpoints_key(job.id)}/step-{step:08d}"
            if step != 3:  # Ray Train removed this one: not listed
                store.write_bytes(f"{path}/trainer_state.json", b"{}")
            s.add(
                Checkpoint(
                    id=new_id("checkpoint"),
                    job_id=job.id,
                    step=step,
                    path=path,
                    metrics={"train_loss": 1.0 / step},
                )
            )
    pages = sdk.fine_tuning.jobs.checkpoints.list(job.id, limit=2)
    assert [c.step_number for c in pages.data] == [6, 5] and pages.has_more
    # auto-pagination ends (it followed the first page forever before `after` was honoured)
    steps = [c.step_number for c in itertools.islice(pages, 20)]
    assert steps == [6, 5, 4, 2, 1]
    rest = sdk.fine_tuning.jobs.checkpoints.list(job.id, after=pages.data[-1].id)
    assert [c.step_number for c in rest.data] == [4, 2, 1] and not rest.has_more
    with pytest.raises(openai.NotFoundError, match="'checkpoint-missing'"):
        sdk.fine_tuning.jobs.checkpoints.list(job.id, after="checkpoint-missing")


def test_owner_deletes_its_fine_tuned_model(
    sdk: OpenAI,
    app_client: TestClient,
    key_a: str,
    key_b: str,
    a_objects: dict[str, Any],
    settings: Settings,
) -> None:
    model, job_id = a_objects["model"], a_objects["job"]
    url = settings.resolved_database_url
    store = artifact_store(settings)
    store.write_bytes(f"{store.adapter_key(job_id)}/adapter_model.safetensors", b"w")
    store.write_bytes(f"{store.merged_key(job_id)}/model.safetensors", b"w")
    with session_scope(url) as s:  # what the controller's success leaves on the job
        s.execute(update(Job).where(Job.id == job_id).values(fine_tuned_model=model))
    shares = f"/v1/models/{model}/shares"
    for _ in range(2):  # the share routes still answer under the delete route's path
        assert app_client.post(shares, json={"tenant": "tenant-b"}, headers=H(key_a)).json()[
            "data"
        ] == ["tenant-b"]
        resp = app_client.delete(f"{shares}/tenant-b", headers=H(key_a))
        assert resp.status_code == 200 and resp.json()["data"] == []
    app_client.post(shares, json={"tenant": "tenant-b"}, headers=H(key_a))

    # neither a tenant it is shared with, nor a base model, nor a model no one has
    resp = app_client.delete(f"/v1/models/{model}", headers=H(key_b))
    assert resp.status_code == 404 and repr(model) in resp.json()["error"]["message"]
    resp = app_client.delete(f"/v1/models/{TINY}", headers=H(key_a))
    assert resp.status_code == 403
    assert f"{TINY!r} is a base model" in resp.json()["error"]["message"]
    assert "cannot be deleted" in resp.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError, match="'ft:tiny-llama:nobody::x'"):
        sdk.models.delete("ft:tiny-llama:nobody::x")
    with session_scope(url) as s:
        assert serving_config(s, TINY)["prefetch"] == [job_id]

    deleted = sdk.models.delete(model)
    assert (deleted.id, deleted.object, deleted.deleted) == (model, "model", True)
    assert not store.exists(store.adapter_key(job_id))
    assert not store.exists(store.merged_key(job_id))
    with session_scope(url) as s:
        assert s.scalars(select(Adapter)).all() == []
        assert s.scalars(select(AdapterShare)).all() == []
        assert serving_config(s, TINY) == {"merged": [], "pinned": [], "prefetch": []}
    assert sdk.fine_tuning.jobs.retrieve(job_id).fine_tuned_model == model
    for key in (key_a, key_b):
        listed = [m["id"] for m in app_client.get("/v1/models", headers=H(key)).json()["data"]]
        assert listed == [TINY]
        assert app_client.get(f"/v1/models/{model}", headers=H(key)).status_code == 404
    with pytest.raises(openai.NotFoundError):
        sdk.models.delete(model)


def test_base_models_have_their_registry_time(
    sdk: OpenAI, settings: Settings, tiny_registry: Any
) -> None:
    added = int((tiny_registry / TINY / "config.json").stat().st_mtime)
    assert added > 0
    assert [(m.id, m.created) for m in sdk.models.list()] == [(TINY, added)]
    assert sdk.models.retrieve(TINY).created == added


def test_metadata_is_an_empty_object_when_none_was_given(
    sdk: OpenAI, app_client: TestClient, key_a: str
) -> None:
    job = sdk.fine_tuning.jobs.create(model=TINY, training_file=_upload(sdk))
    assert job.metadata == {}
    assert sdk.fine_tuning.jobs.retrieve(job.id).metadata == {}
    listed = app_client.get("/v1/fine_tuning/jobs", headers=H(key_a)).json()["data"]
    assert [j["metadata"] for j in listed] == [{}]


def test_a_serving_failure_in_plain_text_reaches_the_sdk_as_an_error_object(
    settings: Settings, live_server: Any, key_a: str
) -> None:
    """Ray Serve's proxy answers some failures (a replica that died mid-request) in plain
    text; the SDK still gets an error object naming the base model and what Serve said,
    as a 503 it retries."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse
    from starlette.routing import Route

    calls: list[str] = []

    async def crashed(request: Request) -> PlainTextResponse:
        calls.append(request.url.path)
        return PlainTextResponse("Internal Server Error", status_code=500)

    async def alive(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    serve = live_server(
        Starlette(
            routes=[
                Route("/healthz", alive),
                Route("/{path:path}", crashed, methods=["POST"]),
            ]
        )
    )
    host, port = serve.removeprefix("http://").split(":")
    api = create_app(settings.model_copy(update={"serve_host": host, "serve_port": int(port)}))
    with TestClient(api) as client:
        sdk = OpenAI(base_url="http://testserver/v1", api_key=key_a, http_client=client)
        with pytest.raises(openai.InternalServerError) as failed:
            sdk.chat.completions.create(model=TINY, messages=[{"role": "user", "content": "hi"}])
    assert failed.value.status_code == 503 and len(calls) == 3  # retried twice, as 5xx are
    error = failed.value.body
    assert isinstance(error, dict) and error["code"] == "unavailable", error
    assert TINY in error["message"] and "500 'Internal Server Error'" in error["message"]
