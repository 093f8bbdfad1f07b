"""Admin routes (admin keys only), quotas at admission, concurrent idempotent creates."""

from __future__ import annotations

import threading
from collections.abc import Callable

import httpx
from fastapi.testclient import TestClient
from sqlalchemy import select

from conftest import auth as H
from conftest import upload_chat
from dashboard_client import admin_key
from tunefleet.platform.db import Job, JobEvent, session_scope
from tunefleet.platform.settings import Settings


def test_admin_routes_need_an_admin_key(app_client: TestClient, key_a: str) -> None:
    resp = app_client.get("/v1/admin/tenants", headers=H(key_a))
    assert resp.status_code == 403
    assert resp.json()["error"]["type"] == "permission_error"
    assert "tenant-a" in resp.json()["error"]["message"]


def test_admin_manages_tenants_keys_and_sees_all_jobs(
    app_client: TestClient, settings: Settings, key_a: str
) -> None:
    admin = admin_key(settings)
    made = app_client.post(
        "/v1/admin/tenants", headers=H(admin), json={"name": "newco", "max_gpus": 0}
    ).json()
    assert made["name"] == "newco" and made["api_key"].startswith("tf-")
    assert app_client.get("/v1/fine_tuning/jobs", headers=H(made["api_key"])).status_code == 200
    dup = app_client.post("/v1/admin/tenants", headers=H(admin), json={"name": "newco"})
    assert dup.status_code == 409
    names = [
        t["name"] for t in app_client.get("/v1/admin/tenants", headers=H(admin)).json()["data"]
    ]
    assert {"tenant-a", "ops", "newco"} <= set(names)

    key = app_client.post(
        f"/v1/admin/tenants/{made['id']}/keys", headers=H(admin), json={"name": "ci"}
    ).json()
    assert app_client.get("/v1/files", headers=H(key["api_key"])).status_code == 200
    revoked = app_client.delete(f"/v1/admin/keys/{key['id']}", headers=H(admin)).json()
    assert revoked["revoked"]
    assert app_client.get("/v1/files", headers=H(key["api_key"])).status_code == 401

    # GPU quota checked at admission: newco may use 0 GPUs
    f = upload_chat(app_client, made["api_key"])
    body = {
        "model": "tiny-llama",
        "training_file": f["id"],
        "tunefleet": {"resources": {"num_workers": 2, "gpus_per_worker": 1}},
    }
    over = app_client.post("/v1/fine_tuning/jobs", headers=H(made["api_key"]), json=body)
    assert over.status_code == 429
    assert over.json()["error"]["code"] == "quota_exceeded"
    assert "asks for 2 GPUs" in over.json()["error"]["message"]
    raised = app_client.patch(
        f"/v1/admin/tenants/{made['id']}", headers=H(admin), json={"max_gpus": 2}
    )
    assert raised.status_code == 200 and raised.json()["max_gpus"] == 2, raised.text
    ok = app_client.post("/v1/fine_tuning/jobs", headers=H(made["api_key"]), json=body)
    assert ok.status_code == 200

    everyone = app_client.get("/v1/admin/jobs", headers=H(admin)).json()["data"]
    assert [j["id"] for j in everyone] == [ok.json()["id"]]


def test_a_tenant_waiting_jobs_are_capped(app_client: TestClient, settings: Settings) -> None:
    """A tenant could fill the queue (and the admission thread) without bound; past its
    ``max_waiting_jobs`` a create answers 429 naming the limit and the fix, and a slot
    freed (a waiting job cancelled) takes a job again."""
    admin = admin_key(settings)
    made = app_client.post(
        "/v1/admin/tenants", headers=H(admin), json={"name": "busy", "max_waiting_jobs": 2}
    ).json()
    assert made["max_waiting_jobs"] == 2
    key = made["api_key"]
    f = upload_chat(app_client, key)
    body = {"model": "tiny-llama", "training_file": f["id"]}
    first, second = (
        app_client.post("/v1/fine_tuning/jobs", headers=H(key), json=body) for _ in range(2)
    )
    assert first.status_code == second.status_code == 200
    over = app_client.post("/v1/fine_tuning/jobs", headers=H(key), json=body)
    assert over.status_code == 429, over.text
    error = over.json()["error"]
    assert error["code"] == "too_many_waiting_jobs"
    assert "2 jobs waiting" in error["message"] and "max_waiting_jobs" in error["message"]
    listed = app_client.get("/v1/fine_tuning/jobs", headers=H(key)).json()["data"]
    assert len(listed) == 2  # nothing stored for the refused create

    cancelled = app_client.post(f"/v1/fine_tuning/jobs/{first.json()['id']}/cancel", headers=H(key))
    assert cancelled.status_code == 200
    assert app_client.post("/v1/fine_tuning/jobs", headers=H(key), json=body).status_code == 200
    raised = app_client.patch(
        f"/v1/admin/tenants/{made['id']}", headers=H(admin), json={"max_waiting_jobs": 3}
    )
    assert raised.json()["max_waiting_jobs"] == 3
    assert app_client.post("/v1/fine_tuning/jobs", headers=H(key), json=body).status_code == 200


def test_concurrent_retries_with_one_idempotency_key_make_one_job(
    live_server: Callable[..., str], key_a: str, settings: Settings
) -> None:
    """Retries of one create, released together against two API servers on one database
    (each its own event loop, as the deployment's uvicorn workers are), all answer 200
    with the one job that the unique index let in; the losers leave nothing behind."""
    urls = [live_server(), live_server()]
    with httpx.Client(base_url=urls[0]) as client:
        f = upload_chat(client, key_a)
    body = {"model": "tiny-llama", "training_file": f["id"]}
    headers = {**H(key_a), "Idempotency-Key": "same"}
    racers = 16
    barrier = threading.Barrier(racers)
    responses: dict[int, httpx.Response] = {}
    errors: list[Exception] = []

    def create(i: int) -> None:
        try:
            with httpx.Client(base_url=urls[i % len(urls)], timeout=60) as client:
                # open the connection first, so the barrier releases only the POSTs
                assert client.get("/healthz").status_code == 200
                barrier.wait(timeout=30)
                responses[i] = client.post("/v1/fine_tuning/jobs", json=body, headers=headers)
        except Exception as e:  # reported below, with the thread it came from
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=create, args=(i,)) for i in range(racers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == [] and len(responses) == racers
    answers = [(r.status_code, r.text) for r in responses.values()]
    assert [status for status, _ in answers] == [200] * racers, answers
    jobs = {r.json()["id"]: r.json() for r in responses.values()}
    assert len(jobs) == 1, sorted(jobs)
    (job_id, job), *_ = jobs.items()
    assert job["status"] == "validating_files" and job["training_file"] == f["id"]
    with session_scope(settings.resolved_database_url) as s:
        stored = [(j.id, j.idempotency_key) for j in s.scalars(select(Job))]
        assert stored == [(job_id, "same")]
        assert list(s.scalars(select(JobEvent.job_id))) == [job_id]


def test_admin_adds_lists_and_deletes_webhook_endpoints_and_reads_their_log(
    app_client: TestClient, settings: Settings, key_a: str
) -> None:
    admin = admin_key(settings)
    tenants = app_client.get("/v1/admin/tenants", headers=H(admin)).json()["data"]
    tenant_a = next(t["id"] for t in tenants if t["name"] == "tenant-a")
    path = f"/v1/admin/tenants/{tenant_a}/webhooks"

    refused = app_client.post(path, headers=H(key_a), json={"url": "https://a.example"})
    assert refused.status_code == 403  # a tenant's own key is not enough
    bad = app_client.post(path, headers=H(admin), json={"url": "file:///etc/passwd"})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "url"
    assert "'file:///etc/passwd' is not an http(s) URL" in bad.json()["error"]["message"]
    for internal in ("http://169.254.169.254/latest/meta-data", "http://127.0.0.1:5432/x"):
        refused = app_client.post(path, headers=H(admin), json={"url": internal})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "url"
        assert "TUNEFLEET_OUTBOUND_ALLOW" in refused.json()["error"]["message"]
    unknown = app_client.post(
        path, headers=H(admin), json={"url": "https://a.example", "events": ["job.done"]}
    )
    assert unknown.status_code == 400 and "['job.done']" in unknown.json()["error"]["message"]
    nowhere = app_client.post(
        "/v1/admin/tenants/tenant-nope/webhooks", headers=H(admin), json={"url": "https://a.b"}
    )
    assert nowhere.status_code == 404

    made = app_client.post(
        path,
        headers=H(admin),
        json={"url": "https://a.example/hook", "events": ["fine_tuning.job.cancelled"]},
    ).json()
    assert made["secret"].startswith("whsec_") and made["events"] == ["fine_tuning.job.cancelled"]
    listed = app_client.get(path, headers=H(admin)).json()["data"]
    assert [e["id"] for e in listed] == [made["id"]]
    assert "secret" not in listed[0]  # shown once, at creation

    # A job of tenant A cancelled: its delivery is in the endpoint's log, pending.
    f = upload_chat(app_client, key_a)
    job = app_client.post(
        "/v1/fine_tuning/jobs",
        headers=H(key_a),
        json={"model": "tiny-llama", "training_file": f["id"]},
    ).json()
    app_client.post(f"/v1/fine_tuning/jobs/{job['id']}/cancel", headers=H(key_a))
    log = app_client.get(f"/v1/admin/webhooks/{made['id']}/deliveries", headers=H(admin)).json()
    [delivery] = log["data"]
    assert (delivery["type"], delivery["job_id"], delivery["status"], delivery["attempts"]) == (
        "fine_tuning.job.cancelled",
        job["id"],
        "pending",
        0,
    )

    gone = app_client.delete(f"/v1/admin/webhooks/{made['id']}", headers=H(admin)).json()
    assert gone == {"id": made["id"], "object": "webhook_endpoint", "deleted": True}
    assert app_client.get(path, headers=H(admin)).json()["data"] == []
    again = app_client.get(f"/v1/admin/webhooks/{made['id']}/deliveries", headers=H(admin))
    assert again.status_code == 404 and made["id"] in again.json()["error"]["message"]
