"""The dashboard driven without a browser, as the API and dashboard tests drive it: an
admin key, signing in through the form, a job made and walked along the state machine."""

from __future__ import annotations

import re
from typing import Any

from fastapi.testclient import TestClient

from conftest import auth as H
from conftest import upload_chat
from tunefleet.platform.db import session_scope
from tunefleet.platform.settings import Settings
from tunefleet.platform.status import JobStatus, transition
from tunefleet.platform.tenants import create_key, create_tenant

S = JobStatus
CSRF_RE = re.compile(r'name="csrf_token" value="([^"]+)"')


def admin_key(settings: Settings) -> str:
    with session_scope(settings.resolved_database_url) as s:
        tenant = create_tenant(s, "ops")
        return create_key(s, tenant.id, is_admin=True)[1]


def csrf_of(html: str) -> str:
    found = CSRF_RE.search(html)
    assert found, html[:500]
    return found.group(1)


def sign_in(client: TestClient, key: str) -> str:
    """Sign ``client`` in with ``key`` through the form; returns the session's CSRF token."""
    form = client.get("/ui/signin")
    assert form.status_code == 200
    resp = client.post(
        "/ui/signin",
        data={"csrf_token": csrf_of(form.text), "api_key": key, "next": "/ui/jobs"},
        follow_redirects=False,
    )
    assert resp.status_code == 303, resp.text
    assert resp.headers["location"] == "/ui/jobs"
    page = client.get("/ui/jobs")
    assert page.status_code == 200
    return csrf_of(page.text)


def new_job(client: TestClient, key: str, **extra: Any) -> str:
    f = upload_chat(client, key)
    body = {"model": "tiny-llama", "training_file": f["id"], **extra}
    resp = client.post("/v1/fine_tuning/jobs", headers=H(key), json=body)
    assert resp.status_code == 200, resp.text
    job_id: str = resp.json()["id"]
    return job_id


def move(settings: Settings, job_id: str, *path: JobStatus) -> None:
    """Walk ``job_id`` along ``path`` (from validating_files), as the controller would."""
    current = S.VALIDATING_FILES
    with session_scope(settings.resolved_database_url) as s:
        for to in path:
            transition(s, job_id, current, to, f"moved to {to.value} by the test")
            current = to
