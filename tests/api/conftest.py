from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
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
def live_server(settings: Settings) -> Iterator[Callable[..., str]]:
    """Start the real app under uvicorn in a background thread, as ``tunefleet.cli.stack``
    runs it, on a free 127.0.0.1 port, and return its base URL: ``live_server()`` serves
    ``create_app(settings)``, ``live_server(app)`` another app. Each call starts another
    server with its own event loop (like another uvicorn worker on the same database).
    TestClient runs handlers one at a time on one loop; these answer real concurrent HTTP
    requests. Every server is stopped at teardown."""
    import uvicorn

    running: list[tuple[uvicorn.Server, threading.Thread, socket.socket]] = []

    def start(app: FastAPI | None = None) -> str:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))  # a socket of our own: no race for a free port number
        host, port = sock.getsockname()
        config = uvicorn.Config(app or create_app(settings), log_level="warning")
        server = uvicorn.Server(config)
        thread = threading.Thread(
            target=server.run, kwargs={"sockets": [sock]}, daemon=True, name=f"api-{port}"
        )
        thread.start()
        running.append((server, thread, sock))
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn on {host}:{port} did not start")
            time.sleep(0.01)
        url = f"http://{host}:{port}"
        # FastAPI builds its routes' state on the first request, silencing a pydantic
        # warning with warnings.catch_warnings, which is not thread-safe: build it here,
        # one server at a time, not in the first concurrent requests.
        assert httpx.get(f"{url}/healthz").status_code == 200
        return url

    yield start
    for server, _, _ in running:
        server.should_exit = True
    for _, thread, sock in running:
        thread.join(10)
        sock.close()
        assert not thread.is_alive(), f"{thread.name} did not stop"


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
