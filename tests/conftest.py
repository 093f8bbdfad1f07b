"""Shared fixtures: settings on a temporary data dir, SQLite and PostgreSQL databases,
a tiny random Llama in a model registry, and an authenticated API client."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from tunefleet.platform.db import session_scope
from tunefleet.platform.db.migrate import upgrade
from tunefleet.platform.settings import Settings
from tunefleet.platform.tenants import create_key, create_tenant

TINY = "tiny-llama"
CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}


def auth(key: str) -> dict[str, str]:
    """The Authorization header of an API key."""
    return {"Authorization": f"Bearer {key}"}


def upload_chat(client: Any, key: str, name: str = "a.jsonl") -> dict[str, Any]:
    """Upload a one-example chat file as ``key``'s tenant; returns the file object."""
    resp = client.post(
        "/v1/files",
        headers=auth(key),
        data={"purpose": "fine-tune"},
        files={"file": (name, json.dumps(CHAT).encode())},
    )
    assert resp.status_code == 200, resp.text
    result: dict[str, Any] = resp.json()
    return result


@pytest.fixture(scope="session")
def pg_server() -> Iterator[str]:
    from pg import postgres_cluster

    with postgres_cluster() as url:
        yield url


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty database (not migrated) of each kind."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'test.db'}"
    server: str = request.getfixturevalue("pg_server")
    name = f"t_{uuid.uuid4().hex[:12]}"
    engine = create_engine(server, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(text(f"CREATE DATABASE {name}"))
    engine.dispose()
    return server.rsplit("/", 1)[0] + f"/{name}"


@pytest.fixture
def migrated_url(db_url: str) -> str:
    upgrade(db_url)
    return db_url


@pytest.fixture(scope="session")
def tiny_registry(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tinyllm import build_tiny_llama

    root = tmp_path_factory.mktemp("models")
    build_tiny_llama(root / TINY)
    return root


@pytest.fixture
def settings(tmp_path: Path, migrated_url: str, tiny_registry: Path) -> Settings:
    return Settings(
        data_dir=tmp_path,
        database_url=migrated_url,
        model_registry=tiny_registry,
        max_upload_bytes=1_000_000,
    )


def make_tenant(url: str, name: str) -> str:
    """Create tenant ``name`` and return a plaintext API key for it."""
    with session_scope(url) as s:
        tenant = create_tenant(s, name)
        return create_key(s, tenant.id)[1]


def add_chat_file(session: Any, store: Any, tenant_id: str, file_id: str, copies: int) -> str:
    """A processed training file of ``copies`` copies of CHAT for ``tenant_id``, written to
    the artifact store and recorded (what a validated upload leaves); returns its id."""
    from tunefleet.platform.db import File

    store.write_bytes(store.file_key(file_id), (json.dumps(CHAT) + "\n").encode() * copies)
    session.add(
        File(
            id=file_id,
            tenant_id=tenant_id,
            filename="t.jsonl",
            purpose="fine-tune",
            bytes=1,
            status="processed",
            format="chat",
            stats={},
            path=store.file_key(file_id),
        )
    )
    session.flush()
    return file_id
