from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from conftest import auth as H
from conftest import make_tenant, upload_chat
from tunefleet.api import create_app
from tunefleet.platform.db import Adapter, session_scope
from tunefleet.platform.ids import new_id
from tunefleet.platform.settings import Settings


@pytest.fixture
def app_client(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as client:
        yield client


@pytest.fixture
def key_a(settings: Settings) -> str:
    return make_tenant(settings.resolved_database_url, "tenant-a")


@pytest.fixture
def key_b(settings: Settings) -> str:
    return make_tenant(settings.resolved_database_url, "tenant-b")


@pytest.fixture
def a_objects(app_client: TestClient, key_a: str, settings: Settings) -> dict[str, Any]:
    """Tenant A's file, job and an adapter record for the job (as if it had succeeded)."""
    f = upload_chat(app_client, key_a)
    job = app_client.post(
        "/v1/fine_tuning/jobs",
        headers=H(key_a),
        json={"model": "tiny-llama", "training_file": f["id"]},
    ).json()
    name = f"ft:tiny-llama:tenant-a::{job['id']}"
    with session_scope(settings.resolved_database_url) as s:
        s.add(
            Adapter(
                id=new_id("adapter"),
                tenant_id=job["organization_id"],
                job_id=job["id"],
                name=name,
                base_model="tiny-llama",
                path=f"adapters/{job['id']}",
            )
        )
    return {"file": f["id"], "job": job["id"], "model": name}
