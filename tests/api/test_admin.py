"""Admin routes (admin keys only), quotas at admission, concurrent idempotent creates."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from fastapi.testclient import TestClient

from conftest import auth as H
from conftest import upload_chat
from tunefleet.platform.db import session_scope
from tunefleet.platform.settings import Settings
from tunefleet.platform.tenants import create_key, create_tenant


def admin_key(settings: Settings) -> str:
    with session_scope(settings.resolved_database_url) as s:
        tenant = create_tenant(s, "ops")
        return create_key(s, tenant.id, is_admin=True)[1]


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
    app_client.patch(f"/v1/admin/tenants/{made['id']}", headers=H(admin), json={"max_gpus": 2})
    ok = app_client.post("/v1/fine_tuning/jobs", headers=H(made["api_key"]), json=body)
    assert ok.status_code == 200

    everyone = app_client.get("/v1/admin/jobs", headers=H(admin)).json()["data"]
    assert [j["id"] for j in everyone] == [ok.json()["id"]]


def test_concurrent_retries_with_one_idempotency_key_make_one_job(
    app_client: TestClient, key_a: str
) -> None:
    f = upload_chat(app_client, key_a)
    body = {"model": "tiny-llama", "training_file": f["id"]}

    def create(_: int) -> str:
        resp = app_client.post(
            "/v1/fine_tuning/jobs", json=body, headers={**H(key_a), "Idempotency-Key": "same"}
        )
        assert resp.status_code == 200, resp.text
        return str(resp.json()["id"])

    with ThreadPoolExecutor(8) as pool:
        ids = set(pool.map(create, range(16)))
    assert len(ids) == 1
    assert len(app_client.get("/v1/fine_tuning/jobs", headers=H(key_a)).json()["data"]) == 1
