"""Sharing an adapter with another tenant, and choosing how adapters are served (merged or
multiplexed, pinned): who may do what, and the errors that name the bad value."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from conftest import auth as H
from conftest import make_tenant
from tunefleet.platform.db import session_scope
from tunefleet.platform.serving import serving_config
from tunefleet.platform.settings import Settings
from tunefleet.platform.tenants import create_key, create_tenant


def test_owner_shares_and_unshares(
    app_client: TestClient,
    settings: Settings,
    key_a: str,
    key_b: str,
    a_objects: dict[str, Any],
) -> None:
    model = a_objects["model"]
    shares = f"/v1/models/{model}/shares"
    assert app_client.get(shares, headers=H(key_a)).json()["data"] == []
    for _ in range(2):  # idempotent
        resp = app_client.post(shares, json={"tenant": "tenant-b"}, headers=H(key_a))
        assert resp.status_code == 200 and resp.json()["data"] == ["tenant-b"]
    seen = app_client.get(f"/v1/models/{model}", headers=H(key_b))
    assert seen.status_code == 200
    assert (seen.json()["owned_by"], seen.json()["parent"]) == ("tenant-a", "tiny-llama")
    listed = [m["id"] for m in app_client.get("/v1/models", headers=H(key_b)).json()["data"]]
    assert model in listed
    # the tenant it is shared with may call it but not manage it
    assert app_client.get(shares, headers=H(key_b)).status_code == 404
    resp = app_client.delete(f"{shares}/tenant-b", headers=H(key_b))
    assert resp.status_code == 404
    # a name no tenant has is answered as one a tenant has, so sharing cannot be used
    # to learn which tenants exist; the share takes effect if such a tenant is made
    nobody = app_client.post(shares, json={"tenant": "nobody"}, headers=H(key_a))
    assert nobody.status_code == 200 and nobody.json()["data"] == ["nobody", "tenant-b"]
    key_nobody = make_tenant(settings.resolved_database_url, "nobody")
    assert app_client.get(f"/v1/models/{model}", headers=H(key_nobody)).status_code == 200
    gone = app_client.delete(f"{shares}/nobody", headers=H(key_a))
    assert gone.status_code == 200 and gone.json()["data"] == ["tenant-b"]
    assert app_client.get(f"/v1/models/{model}", headers=H(key_nobody)).status_code == 404
    # bad values are named
    resp = app_client.post(shares, json={"tenant": "No Such!"}, headers=H(key_a))
    error = resp.json()["error"]
    assert resp.status_code == 400 and "'No Such!'" in error["message"]
    assert error["param"] == "tenant"
    resp = app_client.post(shares, json={"tenant": "tenant-a"}, headers=H(key_a))
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tenant"
    resp = app_client.post(shares, json={"tenants": "tenant-b"}, headers=H(key_a))
    assert resp.status_code == 400
    resp = app_client.delete(f"{shares}/tenant-b", headers=H(key_a))
    assert resp.status_code == 200 and resp.json()["data"] == []
    assert app_client.get(f"/v1/models/{model}", headers=H(key_b)).status_code == 404
    resp = app_client.delete(f"{shares}/tenant-b", headers=H(key_a))
    assert resp.status_code == 404 and "not shared" in resp.json()["error"]["message"]


def test_admin_sets_serving_mode_and_replicas_read_it(
    app_client: TestClient, key_a: str, settings: Settings, a_objects: dict[str, Any]
) -> None:
    url = settings.resolved_database_url
    with session_scope(url) as s:
        ops = create_tenant(s, "ops")
        admin = create_key(s, ops.id, is_admin=True)[1]
    path = f"/v1/admin/adapters/{a_objects['model']}"
    assert app_client.patch(path, json={"pinned": True}, headers=H(key_a)).status_code == 403
    resp = app_client.patch(path, json={"serving_mode": "fused"}, headers=H(admin))
    assert resp.status_code == 400 and "fused" in resp.text
    resp = app_client.patch("/v1/admin/adapters/ft:nope", json={}, headers=H(admin))
    assert resp.status_code == 404 and "'ft:nope'" in resp.json()["error"]["message"]

    with session_scope(url) as s:
        job = a_objects["job"]
        # every adapter of the base is copied to the replicas' nodes ahead of requests
        assert serving_config(s, "tiny-llama") == {"merged": [], "pinned": [], "prefetch": [job]}
    resp = app_client.patch(path, json={"serving_mode": "merged"}, headers=H(admin))
    assert resp.status_code == 200
    assert (resp.json()["serving_mode"], resp.json()["pinned"]) == ("merged", False)
    resp = app_client.patch(path, json={"pinned": True}, headers=H(admin))
    assert (resp.json()["serving_mode"], resp.json()["pinned"]) == ("merged", True)
    with session_scope(url) as s:
        assert serving_config(s, "tiny-llama") == {
            "merged": [job],
            "pinned": [job],
            "prefetch": [job],
        }
        assert serving_config(s, "other-model") == {"merged": [], "pinned": [], "prefetch": []}
    listed = app_client.get("/v1/admin/adapters", headers=H(admin)).json()["data"]
    assert [(a["model"], a["serving_mode"]) for a in listed] == [(a_objects["model"], "merged")]
