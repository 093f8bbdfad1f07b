"""Tenant isolation over every route: tenant B cannot see, use or change tenant A's files,
jobs, events, checkpoints or adapters; each attempt is a 404 that reveals nothing."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from conftest import auth as H
from conftest import upload_chat

ROUTES = [
    ("GET", "/v1/files/{file}", None),
    ("GET", "/v1/files/{file}/content", None),
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
    ("DELETE", "/v1/models/{model}/shares/tenant-b", None),
    (
        "POST",
        "/v1/chat/completions",
        {"model": "{model}", "messages": [{"role": "user", "content": "hi"}]},
    ),
    ("POST", "/v1/completions", {"model": "{model}", "prompt": "hi", "stream": True}),
]


@pytest.mark.parametrize("method,path,body", ROUTES, ids=[f"{m} {p}" for m, p, _ in ROUTES])
def test_tenant_b_gets_404(
    app_client: TestClient,
    key_b: str,
    a_objects: dict[str, Any],
    method: str,
    path: str,
    body: dict[str, Any] | None,
) -> None:
    own = upload_chat(app_client, key_b, "b.jsonl")["id"]
    fill = {**a_objects, "own": own}
    url = path.format(**fill)
    payload = (
        json.loads(
            json.dumps(body)
            .replace("{own}", own)
            .replace("{file}", fill["file"])
            .replace("{model}", fill["model"])
        )
        if body
        else None
    )
    resp = app_client.request(method, url, headers=H(key_b), json=payload)
    assert resp.status_code == 404, resp.text
    assert resp.json()["error"]["type"] == "invalid_request_error"


def test_tenant_a_still_has_everything(
    app_client: TestClient, key_a: str, key_b: str, a_objects: dict[str, Any]
) -> None:
    for method, path, _body in ROUTES[:6]:
        app_client.request(method, path.format(**a_objects), headers=H(key_b))
    assert app_client.get(f"/v1/files/{a_objects['file']}", headers=H(key_a)).status_code == 200
    job = app_client.get(f"/v1/fine_tuning/jobs/{a_objects['job']}", headers=H(key_a)).json()
    assert job["status"] == "validating_files"
    listed_b = app_client.get("/v1/models", headers=H(key_b)).json()["data"]
    assert a_objects["model"] not in [m["id"] for m in listed_b]
    listed_a = app_client.get("/v1/models", headers=H(key_a)).json()["data"]
    assert a_objects["model"] in [m["id"] for m in listed_a]
    assert app_client.get("/v1/files", headers=H(key_b)).json()["data"] == []
    assert app_client.get("/v1/fine_tuning/jobs", headers=H(key_b)).json()["data"] == []


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
