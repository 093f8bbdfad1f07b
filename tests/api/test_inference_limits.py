"""Per-tenant inference limits (``platform/inference_limits.py``): requests per second and
requests in flight, 429 with Retry-After in OpenAI's shape, per tenant, across API
processes, on both databases. Serve is a stand-in here that answers at once or holds a
request until told; ``tests/e2e/test_thin_path.py`` checks the limits on real Ray Serve.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio.to_thread
import httpx
import openai
import pytest
from openai import OpenAI
from sqlalchemy import func, select
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from conftest import TINY, make_tenant
from conftest import auth as H
from dashboard_client import admin_key
from tunefleet.platform import audit
from tunefleet.platform.db import InferenceLease, session_scope
from tunefleet.platform.errors import RateLimited
from tunefleet.platform.inference_limits import (
    FLUSH_S,
    SLOT_HOLD_S,
    Limiter,
    Limits,
    admit,
    release,
)
from tunefleet.platform.settings import Settings

ANSWER = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 1,
    "model": TINY,
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "yo"},
            "finish_reason": "stop",
        }
    ],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}


class StandIn:
    """Serve's place: answers chat at once, or, for a request whose user message is
    "hold", when ``go`` is set; counts what reached it."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.held = threading.Semaphore(0)  # released once per request that is holding
        self.reached = 0

    def app(self) -> Starlette:
        async def chat(request: Request) -> Response:
            body = await request.json()
            self.reached += 1
            if body["messages"][-1]["content"] == "hold":
                self.held.release()
                await anyio.to_thread.run_sync(self.go.wait)
            if body.get("stream"):

                async def events() -> Any:
                    yield f"data: {json.dumps(ANSWER)}\n\n".encode()
                    yield b"data: [DONE]\n\n"

                return StreamingResponse(events(), media_type="text/event-stream")
            return JSONResponse(ANSWER)

        async def alive(_: Request) -> JSONResponse:
            return JSONResponse({"status": "ok"})

        return Starlette(
            routes=[Route("/healthz", alive), Route("/{path:path}", chat, methods=["POST"])]
        )


@pytest.fixture
def serve(live_server: Callable[..., str]) -> Iterator[tuple[StandIn, dict[str, Any]]]:
    stand_in = StandIn()
    host, port = live_server(stand_in.app()).removeprefix("http://").split(":")
    yield stand_in, {"serve_host": host, "serve_port": int(port)}
    stand_in.go.set()


def _chat(url: str, key: str, content: str = "hi", **more: Any) -> httpx.Response:
    body = {"model": TINY, "messages": [{"role": "user", "content": content}], **more}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=H(key), timeout=30)


def _leases(settings: Settings) -> int:
    with session_scope(settings.resolved_database_url) as s:
        return s.scalar(select(func.count()).select_from(InferenceLease)) or 0


def _leases_freed(settings: Settings) -> bool:
    """Whether every lease is deleted once its slot has been free for ``SLOT_HOLD_S``,
    within a few of the flusher's periods."""
    deadline = time.monotonic() + SLOT_HOLD_S + 10 * FLUSH_S
    while _leases(settings) and time.monotonic() < deadline:
        time.sleep(FLUSH_S / 4)
    return _leases(settings) == 0


@pytest.fixture
def admin(settings: Settings) -> dict[str, str]:
    return H(admin_key(settings))


def _limit(admin: dict[str, str], url: str, tenant: str, **limits: float | None) -> dict[str, Any]:
    """Set tenant ``tenant``'s limits through the admin API; its view afterwards."""
    tenants = httpx.get(f"{url}/v1/admin/tenants", headers=admin).json()["data"]
    tenant_id = next(t["id"] for t in tenants if t["name"] == tenant)
    resp = httpx.patch(f"{url}/v1/admin/tenants/{tenant_id}", json=limits, headers=admin)
    assert resp.status_code == 200, resp.text
    view: dict[str, Any] = resp.json()
    return view


def test_over_its_rate_a_tenant_gets_429_with_retry_after_while_another_is_answered(
    settings: Settings,
    live_server: Callable[..., str],
    serve: tuple[StandIn, dict[str, Any]],
    admin: dict[str, str],
) -> None:
    """Two API servers on one database (two processes' worth): the limit is the tenant's
    across both. A burst of its rate is admitted, the next request refused with the exact
    wait, in OpenAI's rate-limit shape; another tenant in the same second is answered; after
    the wait the tenant is answered again."""
    stand_in, serve_at = serve
    limited = settings.model_copy(update=serve_at)
    apis = [live_server(settings=limited), live_server(settings=limited)]
    key_a = make_tenant(settings.resolved_database_url, "tenant-a")
    key_b = make_tenant(settings.resolved_database_url, "tenant-b")
    view = _limit(admin, apis[0], "tenant-a", inference_requests_per_s=2)
    assert view["inference_requests_per_s"] == 2 and view["inference_concurrent_requests"] is None

    # The third of a burst is refused only if it reaches the bucket within 1/rate (0.5 s)
    # of the first: tenant B's requests warm both servers (their connections, their
    # first grant), then tenant A's three go at once, not one after another's round trip.
    assert [_chat(api, key_b).status_code for api in apis] == [200, 200]
    at_once = threading.Barrier(3)

    def burst(i: int) -> httpx.Response:
        at_once.wait()
        return _chat(apis[i % 2], key_a)

    with ThreadPoolExecutor(3) as pool:
        answers = sorted(pool.map(burst, range(3)), key=lambda a: a.status_code)
    other = _chat(apis[1], key_b)
    assert [a.status_code for a in answers] == [200, 200, 429], [a.text for a in answers]
    refused = answers[2]
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
    assert "tenant 'tenant-a'" in error["message"] and "2 requests per second" in error["message"]
    wait_ms = int(refused.headers["retry-after-ms"])
    assert 0 < wait_ms <= 500  # 1/rate after the first of the two admitted
    assert refused.headers["retry-after"] == "1"  # whole seconds, rounded up
    assert "x-should-retry" not in refused.headers  # waiting helps: SDKs may retry
    assert other.status_code == 200, other.text
    assert stand_in.reached == 5  # the refused request never reached Serve

    time.sleep(wait_ms / 1000 + 0.05)
    assert _chat(apis[1], key_a).status_code == 200
    # back to the operator's default (20/s here): a burst of 5 is admitted
    assert (
        _limit(admin, apis[0], "tenant-a", inference_requests_per_s=None)[
            "inference_requests_per_s"
        ]
        is None
    )
    time.sleep(0.6)  # the burst the rate of 2 had used is refilled
    assert [_chat(apis[0], key_a).status_code for _ in range(5)] == [200] * 5
    with session_scope(settings.resolved_database_url) as s:
        changes = [e for e in audit.entries(s)[0] if e.action == "tenant.quotas"]
    assert [(e.before or {}).get("inference_requests_per_s") for e in changes] == [2, None]


def test_requests_in_flight_are_capped_per_tenant_and_freed_when_answered(
    settings: Settings,
    live_server: Callable[..., str],
    serve: tuple[StandIn, dict[str, Any]],
    admin: dict[str, str],
) -> None:
    """With 2 requests in flight (across two API servers), a third is refused with
    Retry-After while another tenant is answered; when they end (a streamed one at its
    last event) their slots are free again, and nothing stays leased."""
    stand_in, serve_at = serve
    limited = settings.model_copy(update=serve_at)
    apis = [live_server(settings=limited), live_server(settings=limited)]
    key_a = make_tenant(settings.resolved_database_url, "tenant-a")
    key_b = make_tenant(settings.resolved_database_url, "tenant-b")
    _limit(admin, apis[0], "tenant-a", inference_concurrent_requests=2)

    with ThreadPoolExecutor(2) as pool:
        held = [
            pool.submit(_chat, apis[0], key_a, "hold"),
            pool.submit(_chat, apis[1], key_a, "hold", stream=True),
        ]
        for _ in held:
            assert stand_in.held.acquire(timeout=30)
        assert _leases(settings) == 2
        refused = _chat(apis[1], key_a)
        assert refused.status_code == 429, refused.text
        error = refused.json()["error"]
        assert (
            error["code"] == "rate_limit_exceeded"
            and "2 inference requests in flight" in (error["message"])
        )
        assert refused.headers["retry-after"] == "1"
        assert _chat(apis[0], key_b).status_code == 200  # another tenant is not held up
        stand_in.go.set()
        answered = [f.result(timeout=30) for f in held]
    assert [a.status_code for a in answered] == [200, 200]
    assert answered[1].text.endswith("data: [DONE]\n\n")
    assert _leases_freed(settings)
    assert [_chat(apis[i], key_a).status_code for i in (0, 1)] == [200, 200]


def test_a_client_that_leaves_mid_answer_gives_its_slot_back(
    settings: Settings,
    live_server: Callable[..., str],
    serve: tuple[StandIn, dict[str, Any]],
    admin: dict[str, str],
) -> None:
    stand_in, serve_at = serve
    api = live_server(settings=settings.model_copy(update=serve_at))
    key_a = make_tenant(settings.resolved_database_url, "tenant-a")
    _limit(admin, api, "tenant-a", inference_concurrent_requests=1)
    with pytest.raises(httpx.ReadTimeout):
        _chat_timeout = httpx.Timeout(30, read=1.0)
        body = {"model": TINY, "messages": [{"role": "user", "content": "hold"}]}
        httpx.post(f"{api}/v1/chat/completions", json=body, headers=H(key_a), timeout=_chat_timeout)
    assert _leases(settings) == 1  # Serve is still working on it
    stand_in.go.set()
    assert _leases_freed(settings)
    assert _chat(api, key_a).status_code == 200


def test_the_openai_sdk_waits_the_retry_after_and_succeeds(
    settings: Settings,
    live_server: Callable[..., str],
    serve: tuple[StandIn, dict[str, Any]],
    admin: dict[str, str],
) -> None:
    """The SDK reads retry-after-ms: a tenant at 1 request per second sends two at once,
    and the second is answered after the SDK's own wait, not failed."""
    _, serve_at = serve
    api = live_server(settings=settings.model_copy(update=serve_at))
    key_a = make_tenant(settings.resolved_database_url, "tenant-a")
    _limit(admin, api, "tenant-a", inference_requests_per_s=1)
    sdk = OpenAI(base_url=f"{api}/v1", api_key=key_a, max_retries=2)
    messages: Any = [{"role": "user", "content": "hi"}]
    started = time.monotonic()
    for _ in range(2):
        assert sdk.chat.completions.create(model=TINY, messages=messages).choices
    assert time.monotonic() - started >= 0.9  # the second waited for its token
    strict = OpenAI(base_url=f"{api}/v1", api_key=key_a, max_retries=0)
    with pytest.raises(openai.RateLimitError) as refused:
        strict.chat.completions.create(model=TINY, messages=messages)
    assert refused.value.code == "rate_limit_exceeded"


def test_unknown_models_use_no_allowance(
    settings: Settings,
    live_server: Callable[..., str],
    serve: tuple[StandIn, dict[str, Any]],
    admin: dict[str, str],
) -> None:
    _, serve_at = serve
    api = live_server(settings=settings.model_copy(update=serve_at))
    key_a = make_tenant(settings.resolved_database_url, "tenant-a")
    _limit(admin, api, "tenant-a", inference_requests_per_s=1)
    body = {"model": "ft:nope", "messages": [{"role": "user", "content": "hi"}]}
    for _ in range(3):
        resp = httpx.post(f"{api}/v1/chat/completions", json=body, headers=H(key_a))
        assert resp.status_code == 404, resp.text
    assert _chat(api, key_a).status_code == 200


def test_the_rate_admits_a_burst_then_one_request_per_interval(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GCRA on the database, on a clock the test moves: at 4 requests per second, a burst
    of 4, then one every 0.25 s, each refusal naming the exact wait; no limits write
    nothing; a rate of 0 with a concurrency limit checks only the concurrency."""
    url = settings.resolved_database_url
    with session_scope(url) as s:
        from tunefleet.platform.tenants import create_tenant

        tenant = create_tenant(s, "clocked").id
    clock = [1_000_000.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    rate = Limits(requests_per_s=4, concurrent_requests=0)
    assert [admit(url, tenant, "clocked", rate) for _ in range(4)] == [None] * 4
    with pytest.raises(RateLimited) as refused:
        admit(url, tenant, "clocked", rate)
    assert refused.value.retry_after_s == pytest.approx(0.25)
    clock[0] += 0.1
    with pytest.raises(RateLimited) as refused:
        admit(url, tenant, "clocked", rate)
    assert refused.value.retry_after_s == pytest.approx(0.15)
    admitted = 0
    for _ in range(40):  # 10 s at 4 per second after the burst
        clock[0] += 0.25
        try:
            admit(url, tenant, "clocked", rate)
            admitted += 1
        except RateLimited:
            pass
    assert admitted == 40
    assert admit(url, tenant, "clocked", Limits(0, 0)) is None
    slots = Limits(requests_per_s=0, concurrent_requests=3)
    leases = [admit(url, tenant, "clocked", slots) for _ in range(3)]
    with pytest.raises(RateLimited, match="3 inference requests in flight"):
        admit(url, tenant, "clocked", slots)
    assert all(lease is not None for lease in leases)
    release(url, leases[0])  # type: ignore[arg-type]
    # queued: this process's next admission frees it before it counts
    assert admit(url, tenant, "clocked", slots) is not None
    # a lease outlives no API process: past its expiry it counts no more
    clock[0] += 3600
    assert admit(url, tenant, "clocked", slots) is not None


def test_a_changed_rate_starts_with_a_full_burst(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tenant that used its allowance at 1 request per second, then raised to 20 by an
    admin, gets the new rate's whole burst at once: the bucket paced at the old rate is
    started afresh (kept, its arrival time a second ahead refused the first second of
    the new burst). An unchanged rate keeps its bucket: a quota change elsewhere refills
    nothing."""
    from tunefleet.platform.tenants import create_tenant, set_quotas

    url = settings.resolved_database_url
    with session_scope(url) as s:
        tenant = create_tenant(s, "raised").id
    clock = [2_000_000.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])

    def burst(rate: float) -> int:
        admitted = 0
        for _ in range(25):
            try:
                admit(url, tenant, "raised", Limits(requests_per_s=rate, concurrent_requests=0))
                admitted += 1
            except RateLimited:
                break
        return admitted

    with session_scope(url) as s:
        set_quotas(s, tenant, inference_requests_per_s=1)
    assert burst(1) == 1
    with session_scope(url) as s:
        set_quotas(s, tenant, max_waiting_jobs=9, inference_requests_per_s=1)
    assert burst(1) == 0  # the same rate: the same bucket
    with session_scope(url) as s:
        set_quotas(s, tenant, inference_requests_per_s=20)
    assert burst(20) == 20


def test_concurrent_admissions_of_one_tenant_are_counted_exactly(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """32 admissions at once from 8 API processes (``Limiter``s, 4 threads each, each
    thread its own connection): exactly the burst of a rate of 7, and exactly 5 slots of a
    concurrency of 5, are admitted. On PostgreSQL the bucket row's lock orders the
    processes' trips; without it each would count only the leases committed before it
    began. In one process, at 20 per second (grants of 5 tokens), exactly the burst."""
    from tunefleet.platform.tenants import create_tenant

    url = settings.resolved_database_url
    with session_scope(url) as s:
        tenants = [create_tenant(s, name).id for name in ("rated", "slotted", "granted")]
    monkeypatch.setattr(time, "time", lambda: 2_000_000.0)  # no refill while they run
    cases = ((Limits(7, 0), 8, 7), (Limits(0, 5), 8, 5), (Limits(20, 0), 1, 20))
    for tenant, (limits, processes, room) in zip(tenants, cases, strict=True):
        start = threading.Barrier(32)
        limiters = [Limiter() for _ in range(processes)]

        def one(i: int, tenant: str = tenant, limits: Limits = limits, start: Any = start,
                limiters: list[Limiter] = limiters) -> bool:  # fmt: skip
            start.wait()
            try:
                limiters[i % len(limiters)].admit(url, tenant, "t", limits)
            except RateLimited:
                return False
            return True

        with ThreadPoolExecutor(32) as pool:
            assert sum(pool.map(one, range(32))) == room, limits


def test_a_process_takes_its_allowance_in_grants_and_the_bound_holds(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At 20 per second an API process takes 5 tokens a trip and keeps the 4 it has not
    spent: the rate over time is exact, and after a pause the burst is exceeded by at most
    the 4 each process holds (two here: 28 at once, never more). A slot freed in one
    process is reused there with no database trip; the other process gets it once it has
    been free for SLOT_HOLD_S, and until then is refused with that wait."""
    from tunefleet.platform.tenants import create_tenant

    url = settings.resolved_database_url
    with session_scope(url) as s:
        rated, slotted = create_tenant(s, "rated").id, create_tenant(s, "slotted").id
    clock = [3_000_000.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    a, b = Limiter(), Limiter()
    rate = Limits(requests_per_s=20, concurrent_requests=0)

    def burst(limiter: Limiter) -> int:
        admitted = 0
        for _ in range(40):
            try:
                limiter.admit(url, rated, "rated", rate)
                admitted += 1
            except RateLimited:
                break
        return admitted

    assert a.admit(url, rated, "rated", rate) is None  # a holds 4 tokens
    assert b.admit(url, rated, "rated", rate) is None  # b too
    assert burst(a) + burst(b) == 18  # 20 in all, at one instant: the burst exactly
    for i in range(100):  # 10 s at 10 a second, half the rate, by turns: all admitted
        clock[0] += 0.1
        assert (a, b)[i % 2].admit(url, rated, "rated", rate) is None
    clock[0] += 10  # the bucket is full again, and each process holds what it was granted
    assert 20 <= burst(a) + burst(b) <= 20 + 2 * (rate.grant - 1)

    slots = Limits(requests_per_s=0, concurrent_requests=1)
    lease = a.admit(url, slotted, "slotted", slots)
    assert lease is not None
    a.release(url, lease)
    again = a.admit(url, slotted, "slotted", slots)
    assert again == lease  # the same row, no trip
    assert again is not None
    a.release(url, again)
    with pytest.raises(RateLimited, match="1 inference requests in flight") as refused:
        b.admit(url, slotted, "slotted", slots)
    assert refused.value.retry_after_s == SLOT_HOLD_S
    deadline = time.monotonic() + SLOT_HOLD_S + 10 * FLUSH_S
    while _leases(settings) and time.monotonic() < deadline:
        time.sleep(FLUSH_S / 4)
    assert b.admit(url, slotted, "slotted", slots) is not None
