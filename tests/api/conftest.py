from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from conftest import make_tenant
from tunefleet.api import create_app
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
