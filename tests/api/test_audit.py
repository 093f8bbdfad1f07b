"""The audit log (``platform.audit``): each admin act through the REST API, the dashboard
and the CLI leaves one entry with the right actor, target, before and after; an admin's
act on another tenant's job is recorded and named in the job's own events; the log is
read through ``GET /v1/admin/audit`` (admins only, newest first, filtered and paged) and
on the dashboard's admin page. Admins do not see other tenants' file contents on the
dashboard (refused, as REST refuses them)."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import select
from typer.testing import CliRunner

from conftest import auth as H
from conftest import upload_chat
from dashboard_client import admin_key, csrf_of, move, new_job, sign_in
from tunefleet.cli.main import app as cli
from tunefleet.platform.db import ApiKey, AuditEntry, JobEvent, session_scope
from tunefleet.platform.settings import Settings
from tunefleet.platform.status import JobStatus as S


def _entries(settings: Settings) -> list[AuditEntry]:
    with session_scope(settings.resolved_database_url) as s:
        rows = list(s.scalars(select(AuditEntry).order_by(AuditEntry.created_ns)))
        s.expunge_all()
    return rows


def _admin_key_id(settings: Settings) -> str:
    with session_scope(settings.resolved_database_url) as s:
        return s.scalars(select(ApiKey.id).where(ApiKey.is_admin)).one()


def test_each_admin_act_through_the_api_leaves_one_entry_with_its_actor(
    app_client: TestClient, settings: Settings, key_a: str, a_objects: dict[str, Any]
) -> None:
    admin = admin_key(settings)
    admin_id = _admin_key_id(settings)
    assert _entries(settings) == []  # the fixtures' own setup is not an admin's act
    made = app_client.post(
        "/v1/admin/tenants", headers=H(admin), json={"name": "newco", "max_gpus": 2}
    ).json()
    tenant = made["id"]
    app_client.patch(f"/v1/admin/tenants/{tenant}", headers=H(admin), json={"max_gpus": 4})
    key = app_client.post(
        f"/v1/admin/tenants/{tenant}/keys", headers=H(admin), json={"name": "ci"}
    ).json()
    app_client.delete(f"/v1/admin/keys/{key['id']}", headers=H(admin))
    model = a_objects["model"]
    app_client.patch(f"/v1/admin/adapters/{model}", headers=H(admin), json={"pinned": True})
    hook = app_client.post(
        f"/v1/admin/tenants/{tenant}/webhooks", headers=H(admin), json={"url": "https://a.example"}
    ).json()
    app_client.delete(f"/v1/admin/webhooks/{hook['id']}", headers=H(admin))

    entries = _entries(settings)
    assert [e.action for e in entries] == [
        "tenant.create",
        "key.create",  # the new tenant's first key
        "tenant.quotas",
        "key.create",
        "key.revoke",
        "adapter.serving",
        "webhook.create",
        "webhook.delete",
    ]
    assert {(e.actor_key_id, e.via) for e in entries} == {(admin_id, "api")}
    quotas = entries[2]
    assert (quotas.target_type, quotas.target_id, quotas.tenant_id) == ("tenant", tenant, tenant)
    defaults = {"inference_requests_per_s": None, "inference_concurrent_requests": None}
    kept = {"max_concurrent_jobs": 4, "max_waiting_jobs": 100, **defaults}
    assert quotas.before == {**kept, "max_gpus": 2}
    assert quotas.after == {**kept, "max_gpus": 4}
    revoked = entries[4]
    assert revoked.target_id == key["id"] and revoked.before == {"revoked_at": None}
    assert isinstance((revoked.after or {}).get("revoked_at"), int)
    assert "api_key" not in str(entries[3].after) and key["api_key"] not in str(entries[3].after)
    serving = entries[5]
    owner = app_client.get(f"/v1/fine_tuning/jobs/{a_objects['job']}", headers=H(key_a))
    assert (serving.target_id, serving.tenant_id) == (model, owner.json()["organization_id"])
    assert serving.before == {"serving_mode": "multiplexed", "pinned": False}
    assert serving.after == {"serving_mode": "multiplexed", "pinned": True}
    assert entries[7].before == {"url": "https://a.example", "events": hook["events"]}

    # read back: newest first, by tenant, by action, paged; admins only
    log = app_client.get("/v1/admin/audit", headers=H(admin)).json()
    assert [e["action"] for e in log["data"]] == [e.action for e in reversed(entries)]
    assert log["data"][0]["actor"] == {
        "key_id": admin_id,
        "tenant_id": log["data"][0]["actor"]["tenant_id"],
        "via": "api",
    }
    assert log["has_more"] is False
    theirs = app_client.get(f"/v1/admin/audit?tenant_id={tenant}", headers=H(admin)).json()
    assert {e["target"]["tenant_id"] for e in theirs["data"]} == {tenant}
    assert len(theirs["data"]) == 7
    keys = app_client.get("/v1/admin/audit?action=key.create", headers=H(admin)).json()
    assert len(keys["data"]) == 2
    first = app_client.get("/v1/admin/audit?limit=3", headers=H(admin)).json()
    rest = app_client.get(
        f"/v1/admin/audit?limit=10&after={first['last_id']}", headers=H(admin)
    ).json()
    assert first["has_more"] and not rest["has_more"]
    assert [e["id"] for e in first["data"] + rest["data"]] == [e.id for e in reversed(entries)]
    assert app_client.get("/v1/admin/audit", headers=H(key_a)).status_code == 403


def test_dashboard_acts_and_an_admins_move_of_another_tenants_job_are_recorded(
    app_client: TestClient, settings: Settings, key_a: str
) -> None:
    job_id = new_job(app_client, key_a)
    move(settings, job_id, S.QUEUED)
    # the tenant pauses its own job through the API: named in the event, not an admin act
    app_client.post(f"/v1/fine_tuning/jobs/{job_id}/pause", headers=H(key_a))
    assert _entries(settings) == []

    admin = admin_key(settings)
    admin_id = _admin_key_id(settings)
    csrf = sign_in(app_client, admin)
    resumed = app_client.post(
        f"/ui/jobs/{job_id}/resume", data={"csrf_token": csrf}, follow_redirects=False
    )
    assert resumed.status_code == 303
    page = app_client.get("/ui/admin")
    csrf = csrf_of(page.text)
    tenant_a = next(
        t["id"]
        for t in app_client.get("/v1/admin/tenants", headers=H(admin)).json()["data"]
        if t["name"] == "tenant-a"
    )
    app_client.post(
        f"/ui/admin/tenants/{tenant_a}/quotas",
        data={"csrf_token": csrf, "max_waiting_jobs": "7"},
        follow_redirects=False,
    )
    entries = _entries(settings)
    assert [(e.action, e.actor_key_id, e.via) for e in entries] == [
        ("job.resume", admin_id, "dashboard"),
        ("tenant.quotas", admin_id, "dashboard"),
    ]
    assert (entries[0].target_id, entries[0].tenant_id) == (job_id, tenant_a)
    assert (entries[0].before, entries[0].after) == ({"status": "paused"}, {"status": "queued"})
    assert (entries[1].after or {})["max_waiting_jobs"] == 7

    with session_scope(settings.resolved_database_url) as s:
        messages = [
            m for (m,) in s.execute(
                select(JobEvent.message).where(JobEvent.job_id == job_id).order_by(JobEvent.seq)
            )
        ]  # fmt: skip
    tenant_key = messages[-2].split("key ")[1].split(" ")[0]
    assert messages[-2:] == [
        f"Job paused by key {tenant_key} via the API",
        f"Job resumed by key {admin_id} via the dashboard; queued",
    ]
    # the page lists it
    shown = app_client.get("/ui/admin").text
    assert f'id="audit-{entries[0].id}"' in shown and "job.resume" in shown


def test_the_operators_cli_acts_are_recorded_without_a_key(
    settings: Settings, monkeypatch: Any
) -> None:
    monkeypatch.setenv("TUNEFLEET_DATABASE_URL", settings.resolved_database_url)
    monkeypatch.setenv("TUNEFLEET_DATA_DIR", str(settings.data_dir))
    from tunefleet.platform.settings import get_settings

    get_settings.cache_clear()
    try:
        made = CliRunner().invoke(cli, ["admin", "create-tenant", "cli-co"])
        assert made.exit_code == 0, made.output
    finally:
        get_settings.cache_clear()
    assert [(e.action, e.actor_key_id, e.via) for e in _entries(settings)] == [
        ("tenant.create", None, "cli"),
        ("key.create", None, "cli"),
    ]


def test_an_admin_sees_another_tenants_file_metadata_but_not_its_content(
    app_client: TestClient, settings: Settings, key_a: str
) -> None:
    f = upload_chat(app_client, key_a)
    own = sign_in(app_client, key_a)
    assert own and "file-head" in app_client.get(f"/ui/files/{f['id']}").text
    admin = TestClient(app_client.app)
    sign_in(admin, admin_key(settings))
    page = admin.get(f"/ui/files/{f['id']}")
    assert page.status_code == 200 and f["id"] in page.text
    assert 'id="content-hidden"' in page.text and "file-head" not in page.text
