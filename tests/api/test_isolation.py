"""Tenant isolation over every route: tenant B cannot see, use or change tenant A's files,
jobs, events, checkpoints or adapters; each attempt is a 404 that reveals nothing, and
leaves everything tenant A can read of its objects as it was (the job's status and events,
the model's shares)."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from conftest import CHAT, make_tenant, upload_chat
from conftest import auth as H
from tunefleet.platform.db import session_scope
from tunefleet.platform.settings import Settings
from tunefleet.platform.status import JobStatus, transition
from tunefleet.workers._evals import EvalRuns

ROUTES = [
    ("GET", "/v1/files/{file}", None),
    ("GET", "/v1/files/{file}/content", None),
    ("GET", "/v1/files?after={file}", None),
    ("DELETE", "/v1/files/{file}", None),
    ("GET", "/v1/fine_tuning/jobs/{job}", None),
    ("GET", "/v1/fine_tuning/jobs/{job}/events", None),
    ("GET", "/v1/fine_tuning/jobs/{job}/checkpoints", None),
    ("POST", "/v1/fine_tuning/jobs/{job}/cancel", None),
    ("POST", "/v1/fine_tuning/jobs/{job}/pause", None),
    ("POST", "/v1/fine_tuning/jobs/{job}/resume", None),
    ("GET", "/v1/fine_tuning/jobs?after={job}", None),
    ("POST", "/v1/fine_tuning/jobs", {"model": "tiny-llama", "training_file": "{file}"}),
    (
        "POST",
        "/v1/fine_tuning/jobs",
        {"model": "tiny-llama", "training_file": "{own}", "validation_file": "{file}"},
    ),
    ("GET", "/v1/models/{model}", None),
    ("GET", "/v1/models/{model}/shares", None),
    ("POST", "/v1/models/{model}/shares", {"tenant": "tenant-b"}),
    # A has shared its model with tenant C (the ``a_shared`` fixture): B may not undo it
    ("DELETE", "/v1/models/{model}/shares/tenant-c", None),
    ("DELETE", "/v1/models/{model}", None),
    (
        "POST",
        "/v1/chat/completions",
        {"model": "{model}", "messages": [{"role": "user", "content": "hi"}]},
    ),
    ("POST", "/v1/completions", {"model": "{model}", "prompt": "hi", "stream": True}),
    ("GET", "/v1/evals/{eval}", None),
    ("POST", "/v1/evals/{eval}", {"name": "taken"}),
    ("DELETE", "/v1/evals/{eval}", None),
    ("GET", "/v1/evals?after={eval}", None),
    ("GET", "/v1/evals/{eval}/runs", None),
    ("GET", "/v1/evals/{eval}/runs?after={run}", None),
    ("GET", "/v1/evals/{eval}/runs/{run}", None),
    ("GET", "/v1/evals/{eval}/runs/{run}/output_items", None),
    ("GET", "/v1/evals/{eval}/runs/{run}/output_items/{item}", None),
    # A's second run waits in the queue: a cancel or delete not checking its owner would show
    ("POST", "/v1/evals/{eval}/runs/{queued}/cancel", None),
    ("POST", "/v1/evals/{eval}/runs/{queued}", None),
    ("DELETE", "/v1/evals/{eval}/runs/{queued}", None),
    ("DELETE", "/v1/evals/{eval}/runs/{run}", None),
    ("POST", "/v1/evals/{eval}/runs", {"data_source": {"type": "jsonl", "source": "{items}"}}),
]
A_ITEMS = {"type": "file_content", "content": [{"item": {"answer": "Paris"}}]}


AN_EVAL = {
    "name": "capitals",
    "data_source_config": {
        "type": "custom",
        "item_schema": {"type": "object", "properties": {"answer": {"type": "string"}}},
    },
    "testing_criteria": [
        {
            "type": "string_check",
            "name": "exact",
            "input": "{{item.answer}}",
            "reference": "Paris",
            "operation": "eq",
        }
    ],
}


@pytest.fixture
def a_shared(
    app_client: TestClient, key_a: str, settings: Settings, a_objects: dict[str, Any]
) -> dict[str, Any]:
    """``a_objects``, with A's model shared with a third tenant, tenant C, and an eval of
    A's."""
    make_tenant(settings.resolved_database_url, "tenant-c")
    shares = f"/v1/models/{a_objects['model']}/shares"
    resp = app_client.post(shares, headers=H(key_a), json={"tenant": "tenant-c"})
    assert resp.status_code == 200 and resp.json()["data"] == ["tenant-c"], resp.text
    made = app_client.post("/v1/evals", headers=H(key_a), json=AN_EVAL)
    assert made.status_code == 200, made.text
    eval_id = made.json()["id"]
    runs = f"/v1/evals/{eval_id}/runs"
    ran, queued = (
        app_client.post(
            runs, headers=H(key_a), json={"data_source": {"type": "jsonl", "source": A_ITEMS}}
        )
        for _ in range(2)
    )
    assert ran.status_code == queued.status_code == 200, ran.text
    url = settings.resolved_database_url
    runner = EvalRuns(settings, url, lambda: session_scope(url), lambda base: True)
    runner.execute(ran.json()["id"])  # the controller's eval step, on this run only
    items = app_client.get(f"{runs}/{ran.json()['id']}/output_items", headers=H(key_a)).json()
    assert [i["status"] for i in items["data"]] == ["pass"]
    return {
        **a_objects,
        "eval": eval_id,
        "run": ran.json()["id"],
        "queued": queued.json()["id"],
        "item": items["data"][0]["id"],
    }


def a_state(client: TestClient, key_a: str, a: dict[str, Any]) -> dict[str, Any]:
    """Everything tenant A can read of its file, job and model, and its lists."""
    reads = {
        "file": f"/v1/files/{a['file']}",
        "content": f"/v1/files/{a['file']}/content",
        "files": "/v1/files",
        "job": f"/v1/fine_tuning/jobs/{a['job']}",
        "events": f"/v1/fine_tuning/jobs/{a['job']}/events",
        "checkpoints": f"/v1/fine_tuning/jobs/{a['job']}/checkpoints",
        "jobs": "/v1/fine_tuning/jobs",
        "model": f"/v1/models/{a['model']}",
        "shares": f"/v1/models/{a['model']}/shares",
        "models": "/v1/models",
        "eval": f"/v1/evals/{a['eval']}",
        "evals": "/v1/evals",
        "runs": f"/v1/evals/{a['eval']}/runs",
        "items": f"/v1/evals/{a['eval']}/runs/{a['run']}/output_items",
    }
    state: dict[str, Any] = {}
    for name, url in reads.items():
        resp = client.get(url, headers=H(key_a))
        assert resp.status_code == 200, f"{url}: {resp.text}"
        state[name] = resp.content if name == "content" else resp.json()
    return state


def assert_unchanged(
    client: TestClient, key_a: str, a: dict[str, Any], before: dict[str, Any]
) -> None:
    """A's state is ``before``: the job's status, its events and the shares first, by name,
    so that a failure says what changed."""
    after = a_state(client, key_a, a)
    assert after["job"]["status"] == before["job"]["status"]
    assert [e["message"] for e in after["events"]["data"]] == [
        e["message"] for e in before["events"]["data"]
    ]
    assert after["shares"]["data"] == before["shares"]["data"]
    assert after == before


def attempt(
    client: TestClient,
    key_b: str,
    fill: dict[str, Any],
    method: str,
    path: str,
    body: dict[str, Any] | None,
) -> None:
    """Tenant B's request on A's objects (``fill``: their ids, and B's own file): a 404."""
    url = path.format(**fill)
    payload = (
        json.loads(
            json.dumps(body)
            .replace("{own}", fill["own"])
            .replace("{file}", fill["file"])
            .replace("{model}", fill["model"])
            .replace('"{items}"', json.dumps(A_ITEMS))
        )
        if body
        else None
    )
    resp = client.request(method, url, headers=H(key_b), json=payload)
    assert resp.status_code == 404, f"{method} {url}: {resp.text}"
    assert resp.json()["error"]["type"] == "invalid_request_error"


# A's job waits in the state each of B's moves would start from, so that a move made
# without checking the job's owner would show; the others find it validating files.
STATUS_FOR = {"pause": JobStatus.QUEUED, "resume": JobStatus.PAUSED}
STATUSES = [JobStatus.VALIDATING_FILES, JobStatus.QUEUED, JobStatus.PAUSED]


def put_job_in(settings: Settings, job_id: str, status: JobStatus) -> None:
    """Move a new job (validating files) along STATUSES until it is in ``status``, as the
    controller and its owner's pause would."""
    with session_scope(settings.resolved_database_url) as s:
        for src, dst in itertools.pairwise(STATUSES[: STATUSES.index(status) + 1]):
            transition(s, job_id, src, dst, f"moved to {dst.value} by the test")


@pytest.mark.parametrize("method,path,body", ROUTES, ids=[f"{m} {p}" for m, p, _ in ROUTES])
def test_tenant_b_gets_404(
    app_client: TestClient,
    settings: Settings,
    key_a: str,
    key_b: str,
    a_shared: dict[str, Any],
    method: str,
    path: str,
    body: dict[str, Any] | None,
) -> None:
    own = upload_chat(app_client, key_b, "b.jsonl")["id"]
    status = STATUS_FOR.get(path.rsplit("/", 1)[-1], JobStatus.VALIDATING_FILES)
    put_job_in(settings, a_shared["job"], status)
    before = a_state(app_client, key_a, a_shared)
    assert before["job"]["status"] == status and before["events"]["data"]
    assert before["shares"]["data"] == ["tenant-c"]
    attempt(app_client, key_b, {**a_shared, "own": own}, method, path, body)
    # a 404 that changed nothing: A's job (status, events), file, model and shares as they were
    assert_unchanged(app_client, key_a, a_shared, before)


@pytest.mark.parametrize("status", STATUSES)
def test_tenant_a_still_has_everything(
    app_client: TestClient,
    settings: Settings,
    key_a: str,
    key_b: str,
    a_shared: dict[str, Any],
    status: JobStatus,
) -> None:
    """Every route of ROUTES, one after another, with A's job in each state B's moves
    start from."""
    own = upload_chat(app_client, key_b, "b.jsonl")["id"]
    put_job_in(settings, a_shared["job"], status)
    before = a_state(app_client, key_a, a_shared)
    for method, path, body in ROUTES:
        attempt(app_client, key_b, {**a_shared, "own": own}, method, path, body)
    assert_unchanged(app_client, key_a, a_shared, before)
    assert before["job"]["status"] == status
    assert before["shares"]["data"] == ["tenant-c"]
    assert a_shared["model"] in [m["id"] for m in before["models"]["data"]]
    listed_b = app_client.get("/v1/models", headers=H(key_b)).json()["data"]
    assert a_shared["model"] not in [m["id"] for m in listed_b]
    assert [f["id"] for f in app_client.get("/v1/files", headers=H(key_b)).json()["data"]] == [own]
    assert app_client.get("/v1/fine_tuning/jobs", headers=H(key_b)).json()["data"] == []
    assert app_client.get("/v1/evals", headers=H(key_b)).json()["data"] == []


def test_a_plan_on_another_tenants_file_is_the_plan_for_no_file(
    app_client: TestClient, key_a: str, key_b: str
) -> None:
    """``POST /v1/plans`` is a dry run that does not require its training file (the one
    route here that is no 404). A's file of 1,000 examples settles "auto" batch size for A;
    B sending its id gets the plan for a file that does not exist, learning nothing."""
    many = ((json.dumps(CHAT) + "\n") * 1000).encode()
    resp = app_client.post(
        "/v1/files",
        headers=H(key_a),
        data={"purpose": "fine-tune"},
        files={"file": ("many.jsonl", many)},
    )
    assert resp.status_code == 200, resp.text
    body = {"model": "tiny-llama", "training_file": resp.json()["id"]}
    no_file = {**body, "training_file": "file-x"}

    def plan(key: str, body: dict[str, Any]) -> dict[str, Any]:
        resp = app_client.post("/v1/plans", headers=H(key), json=body)
        assert resp.status_code == 200, resp.text
        result: dict[str, Any] = resp.json()
        return result

    assert plan(key_a, body)["input"]["per_device_batch"] == 32  # the file counts for A
    assert plan(key_a, no_file)["input"]["per_device_batch"] == 4
    assert plan(key_b, body) == plan(key_b, no_file)


def test_an_events_cursor_from_another_job_is_a_404(
    app_client: TestClient, key_a: str, key_b: str, a_objects: dict[str, Any]
) -> None:
    """The ``after`` cursor was looked up among every job's events: tenant B could page its
    own job's events from tenant A's event ids (and learn which ids exist)."""
    a_events = app_client.get(
        f"/v1/fine_tuning/jobs/{a_objects['job']}/events", headers=H(key_a)
    ).json()["data"]
    own = upload_chat(app_client, key_b, "b.jsonl")["id"]
    b_job = app_client.post(
        "/v1/fine_tuning/jobs",
        headers=H(key_b),
        json={"model": "tiny-llama", "training_file": own},
    ).json()["id"]
    resp = app_client.get(
        f"/v1/fine_tuning/jobs/{b_job}/events?after={a_events[0]['id']}", headers=H(key_b)
    )
    assert resp.status_code == 404, resp.text
    assert resp.json()["error"]["param"] == "after"
    # the job's own events page as before
    own_events = app_client.get(f"/v1/fine_tuning/jobs/{b_job}/events", headers=H(key_b)).json()
    cursor = own_events["data"][0]["id"]
    page = app_client.get(f"/v1/fine_tuning/jobs/{b_job}/events?after={cursor}", headers=H(key_b))
    assert page.status_code == 200
    assert [e["id"] for e in page.json()["data"]] == [e["id"] for e in own_events["data"][1:]]
