"""Schemathesis over the API's own OpenAPI document, on SQLite and PostgreSQL.

Every operation in ``/openapi.json`` is called with requests generated from its schema,
valid ones and (where the schema leaves room) invalid ones, in process through the ASGI
app, authenticated with a real admin key, on a database seeded with a real file, two jobs
and a fine-tuned model of each (one for model deletion alone). About half the requests
take those real ids (and the ids of what earlier requests made) in place of generated
ones, so routes get past their lookups (and a quarter of job creations are the smallest
valid job); one in twenty goes without a valid key. Each answer must:

- not be a server error (5xx). The exceptions: the inference routes answer 503
  ``unavailable`` ("serving ... is not reachable"), and ``/readyz`` 503 naming Ray as
  unreachable, the documented answers while no Ray runs, as here; a 503 for any other
  reason (the database) still fails;
- have a status the operation documents, in a content type it documents, matching the
  documented schema (body and headers).

Requests are counted per database and must reach ``MIN_REQUESTS``. Deterministic (the
same requests every run); ``FUZZ_SEED=<int>`` explores other ones. Run with ``-s`` to see
the counts: ``.venv/bin/python -m pytest tests/api/test_fuzz.py -s``.
"""

from __future__ import annotations

import collections
import json
import os
import random
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import hypothesis
import pytest
import schemathesis
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, Phase, given
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import load_all_checks, not_a_server_error

from conftest import CHAT, TINY, upload_chat
from conftest import auth as H
from tunefleet.api import create_app
from tunefleet.platform.db import Adapter, session_scope
from tunefleet.platform.ids import new_id
from tunefleet.platform.settings import Settings
from tunefleet.platform.tenants import create_key, create_tenant

load_all_checks()
from schemathesis.specs.openapi.checks import (  # noqa: E402  (registered by load_all_checks)
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

MIN_REQUESTS = 2000
# Examples per operation and generation mode; an operation with few inputs may run out of
# distinct ones sooner, and one whose only inputs are free strings has no invalid ones.
EXAMPLES = {GenerationMode.POSITIVE: 60, GenerationMode.NEGATIVE: 40}
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
]
SERVING = {"POST /v1/chat/completions", "POST /v1/completions"}
# Operations that must have answered 200 at least once: proof the real ids got through.
MUST_RESOLVE = {
    "DELETE /v1/models/{model}",
    "GET /v1/files/{file_id}",
    "GET /v1/files/{file_id}/content",
    "GET /v1/fine_tuning/jobs/{job_id}",
    "GET /v1/fine_tuning/jobs/{job_id}/events",
    "GET /v1/fine_tuning/jobs/{job_id}/checkpoints",
    "GET /v1/models/{model}",
    "GET /v1/models/{model}/shares",
    "POST /v1/files",
    "POST /v1/fine_tuning/jobs",
    "POST /v1/plans",
}
VALID_FILE = (json.dumps(CHAT) + "\n").encode() * 2
POOL_MAX = 40


@dataclass
class World:
    """The app under test and the real values requests may use."""

    app: FastAPI
    key: str
    values: dict[str, list[str]]
    rng: random.Random
    statuses: dict[str, collections.Counter[int]] = field(
        default_factory=lambda: collections.defaultdict(collections.Counter)
    )

    def remember(self, body: Any) -> None:
        """Keep the ids of files and jobs that requests made, for later requests."""
        if not isinstance(body, dict) or not isinstance(body.get("id"), str):
            return
        kind = {"file-": ["file_id", "body:training_file"], "ftjob-": ["job_id"]}
        for prefix, names in kind.items():
            if body["id"].startswith(prefix):
                for name in names:
                    pool = self.values[name]
                    if body["id"] not in pool and len(pool) < POOL_MAX:
                        pool.append(body["id"])


@pytest.fixture
def world(settings: Settings) -> Iterator[World]:
    # A port bound but not listening: serving is "not reachable" at once, as without Ray.
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    settings = settings.model_copy(update={"serve_port": closed.getsockname()[1]})
    url = settings.resolved_database_url
    with session_scope(url) as s:
        tenant = create_tenant(s, "fuzz")
        key = create_key(s, tenant.id, is_admin=True)[1]
        peer = create_tenant(s, "fuzz-peer")
        peer_key = create_key(s, peer.id)[0]
        ids = {"tenant": tenant.id, "peer": peer.id, "peer_key": peer_key.id}
    app = create_app(settings)
    with TestClient(app) as client:
        file_id = upload_chat(client, key)["id"]
        job_ids = []
        for _ in range(2):
            job = client.post(
                "/v1/fine_tuning/jobs",
                headers=H(key),
                json={"model": TINY, "training_file": file_id},
            )
            assert job.status_code == 200, job.text
            job_ids.append(job.json()["id"])
    job_id = job_ids[0]
    # the second job's model is the one DELETE /v1/models/{model} may delete, so that the
    # operations after it still find the first
    model, doomed = (f"ft:{TINY}:fuzz::{j}" for j in job_ids)
    with session_scope(url) as s:
        for name, made_by in ((model, job_ids[0]), (doomed, job_ids[1])):
            s.add(
                Adapter(
                    id=new_id("adapter"),
                    tenant_id=ids["tenant"],
                    job_id=made_by,
                    name=name,
                    base_model=TINY,
                    path=f"adapters/{made_by}",
                )
            )
    # real values by parameter name, or "body:<field>" for a top-level body field; a key
    # "<operation> <name>" holds one operation's own
    values = {
        "DELETE /v1/models/{model} model": [doomed, TINY],
        "file_id": [file_id],
        "job_id": [job_id],
        "after": [job_id],
        "model": [model, TINY],
        "base_model": [TINY],
        "tenant": ["fuzz-peer"],
        "tenant_id": [ids["peer"], ids["tenant"]],
        "key_id": [ids["peer_key"]],
        "purpose": ["fine-tune"],
        "body:model": [TINY],
        "body:training_file": [file_id],
        "body:validation_file": [file_id],
        "body:tenant": ["fuzz-peer"],
    }
    seed = int(os.environ.get("FUZZ_SEED") or "0")
    yield World(app=app, key=key, values=values, rng=random.Random(seed))
    closed.close()


def _use_real_values(case: Any, world: World) -> None:
    """Put real values in place of generated ones, each with probability 1/2 (drawn from
    the world's own generator: Hypothesis favours edge cases, not even odds)."""
    rng = world.rng
    containers = [("", case.path_parameters), ("", case.query)]
    if isinstance(case.body, dict):
        containers.append(("body:", case.body))
    for prefix, container in containers:
        for name in list(container):
            own = world.values.get(f"{case.operation.label} {prefix}{name}")
            pool = own or world.values.get(prefix + name)
            if pool and rng.random() < 0.5:
                container[name] = rng.choice(pool)
    if case.operation.label in SERVING and isinstance(case.body, dict) and rng.random() < 0.5:
        case.body["model"] = rng.choice(world.values["model"])
    if case.operation.label == "POST /v1/files" and rng.random() < 0.5:
        case.body = {"file": VALID_FILE, "purpose": "fine-tune"}
    # a job body has so many fields that a generated one is rarely valid throughout: one in
    # four is the smallest valid job (the real model and file), so creation is reached
    if case.operation.label == "POST /v1/fine_tuning/jobs" and rng.random() < 0.25:
        case.body = {
            "model": rng.choice(world.values["body:model"]),
            "training_file": rng.choice(world.values["body:training_file"]),
        }


def _authorization(world: World, draw: Callable[..., Any]) -> dict[str, str]:
    """The real key, but one request in twenty has none or a made-up one."""
    # drawn every time: Hypothesis needs the same draws on a replay of the example
    junk = draw(st.text(st.characters(min_codepoint=0, max_codepoint=255), max_size=40))
    choice = world.rng.randrange(20)
    if choice == 0:
        return {}
    if choice == 1:
        return {"Authorization": "Bearer tf-" + junk.replace("\r", "").replace("\n", "")}
    return {"Authorization": f"Bearer {world.key}"}


def _failure(case: Any, response: Any) -> str | None:
    """None when the answer keeps to the document, else what was wrong and a curl line."""
    checks = CHECKS
    serving_away = response.status_code == 503 and case.operation.label in SERVING
    ray_away = response.status_code == 503 and case.operation.label == "GET /readyz"
    if (serving_away and response.json()["error"]["code"] == "unavailable") or (
        ray_away and response.json()["database"] == "ok" and "unreachable" in response.json()["ray"]
    ):
        # documented: no Ray (nor Serve) runs in this test (see the module docstring)
        checks = [c for c in CHECKS if c is not not_a_server_error]
    try:
        case.validate_response(response, checks=checks)
    except (Exception, BaseExceptionGroup) as exc:
        lines = [line for line in str(exc).splitlines() if line.strip()]
        return (
            f"{case.operation.label} -> {response.status_code} "
            f"{response.content[:300]!r}\n    {' | '.join(lines[:8])[:600]}"
        )
    return None


def _settings_for(mode: GenerationMode) -> hypothesis.settings:
    seed = os.environ.get("FUZZ_SEED")
    return hypothesis.settings(
        max_examples=EXAMPLES[mode],
        deadline=None,
        database=None,
        derandomize=seed is None,
        phases=[Phase.explicit, Phase.generate],  # no shrinking: every failure is listed
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )


def test_every_operation_keeps_to_the_openapi_document(world: World, db_kind: str) -> None:
    schema = schemathesis.openapi.from_asgi("/openapi.json", world.app)
    failures: dict[str, str] = {}
    counts: collections.Counter[str] = collections.Counter()
    started = time.monotonic()
    operations = [result.ok() for result in schema.get_all_operations()]
    for operation in operations:
        for mode in EXAMPLES:

            @given(case=operation.as_strategy(generation_mode=mode), data=st.data())
            def call(case: Any, data: st.DataObject) -> None:
                _use_real_values(case, world)
                headers = _authorization(world, data.draw)
                counts[case.operation.label] += 1
                try:
                    response = case.call(headers=headers)
                except Exception as exc:  # the app raised: a 500 (starlette re-raises it)
                    line = f"{case.operation.label} -> 500 {type(exc).__name__}: {exc}"
                    curl = case.as_curl_command(headers=headers)
                    failures.setdefault(line[:160], f"{line[:600]}\n    {curl[:600]}")
                    return
                world.statuses[case.operation.label][response.status_code] += 1
                content_type = response.headers.get("content-type", [""])[0]
                if response.status_code == 200 and content_type == "application/json":
                    world.remember(response.json())
                problem = _failure(case, response)
                if problem is not None:
                    failures.setdefault(problem.split("\n")[0][:160], problem)

            if seed := os.environ.get("FUZZ_SEED"):
                call = hypothesis.seed(int(seed))(call)
            try:
                _settings_for(mode)(call)()
            except hypothesis.errors.Unsatisfiable:
                assert mode is GenerationMode.NEGATIVE  # nothing invalid to send

    elapsed = time.monotonic() - started
    total = sum(counts.values())
    print(f"\nfuzz[{db_kind}]: {total} requests over {len(counts)} operations in {elapsed:.1f} s")
    for label in sorted(world.statuses):
        print(f"  {label}: {dict(sorted(world.statuses[label].items()))}")
    assert not failures, f"{len(failures)} distinct failures:\n" + "\n".join(failures.values())
    assert total >= MIN_REQUESTS, f"only {total} requests; raise EXAMPLES"
    assert set(counts) == {op.label for op in operations}, "an operation was never called"
    unresolved = [label for label in MUST_RESOLVE if not world.statuses[label][200]]
    assert not unresolved, f"never answered 200 (real ids not reaching them): {unresolved}"
