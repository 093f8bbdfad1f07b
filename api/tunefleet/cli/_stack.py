"""Everything of the embedded default in one process: database, local Ray, the controller
loop and the REST API (uvicorn in a thread), started and stopped together."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx

from tunefleet.platform.db import session_scope
from tunefleet.platform.db.migrate import upgrade
from tunefleet.platform.models import BUILTIN_MODEL, ModelRegistry
from tunefleet.platform.settings import Settings
from tunefleet.platform.tenants import ensure_bootstrap_tenant

log = logging.getLogger(__name__)


@dataclass
class Stack:
    settings: Settings
    api_url: str
    bootstrap_key: str | None


def prepare_data(settings: Settings, *, builtin_model: bool) -> str | None:
    """Migrate the database, add the built-in model, create the first tenant and key."""
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade(settings.resolved_database_url)
    if builtin_model:
        from tunefleet.workers.model_registry import prepare_builtin

        registry = ModelRegistry(settings.resolved_model_registry)
        if BUILTIN_MODEL not in registry.names():
            print(f"Preparing the built-in base model {BUILTIN_MODEL} (once, about a minute)...")
        prepare_builtin(registry)
    with session_scope(settings.resolved_database_url) as s:
        return ensure_bootstrap_tenant(s)


@contextmanager
def running_stack(settings: Settings, *, builtin_model: bool = True) -> Iterator[Stack]:
    import uvicorn

    from tunefleet.api import create_app, server_options
    from tunefleet.platform.lease import Lease
    from tunefleet.workers.backend import RayBackend
    from tunefleet.workers.controller import Controller

    key = prepare_data(settings, builtin_model=builtin_model)
    backend = RayBackend(settings)
    backend.connect()
    stop = threading.Event()
    lease = Lease(settings.resolved_database_url, ttl_s=settings.controller_lease_ttl_s)
    controller = Controller(settings, backend, lease=lease)
    ctl_thread = threading.Thread(
        target=controller.run_forever, args=(stop,), daemon=True, name="controller"
    )
    ctl_thread.start()
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(settings),
            host=settings.api_host,
            port=settings.api_port,
            **server_options(settings),
        )
    )
    api_thread = threading.Thread(target=server.run, daemon=True, name="api")
    api_thread.start()
    api_url = f"http://{settings.api_host}:{settings.api_port}"
    _wait_healthy(api_url + "/healthz", 60)
    try:
        yield Stack(settings=settings, api_url=api_url, bootstrap_key=key)
    finally:
        server.should_exit = True
        stop.set()
        api_thread.join(10)
        ctl_thread.join(30)
        backend.shutdown()


def _wait_healthy(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {timeout_s:.0f}s")
