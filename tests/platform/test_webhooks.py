"""The webhook outbox (``platform.webhooks``), on SQLite and PostgreSQL: a job's end puts
one delivery per subscribed endpoint of its tenant in the outbox, in the transaction that
writes the end; deliveries are claimed once, retried on the schedule, given up after the
last retry or a 410, and every attempt is logged."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select

from conftest import add_chat_file
from tunefleet.platform.artifacts import ArtifactStore
from tunefleet.platform.db import WebhookDelivery, session_factory, session_scope
from tunefleet.platform.errors import InvalidRequest
from tunefleet.platform.jobs import JobCreateRequest, create_job
from tunefleet.platform.models import ModelRegistry
from tunefleet.platform.outbound import OutboundPolicy
from tunefleet.platform.settings import Settings
from tunefleet.platform.status import JobStatus, request_move, transition
from tunefleet.platform.tenants import authenticate, create_key, create_tenant
from tunefleet.platform.webhooks import (
    CLAIM_MARGIN_S,
    EVENTS,
    add_endpoint,
    claim_due,
    deliveries,
    record_attempt,
)

DELAYS = (10, 60)
TIMEOUT = 5
PUBLIC = OutboundPolicy()  # the default: public addresses only


def _tenant_with_job(settings: Settings, name: str) -> tuple[str, str]:
    url = settings.resolved_database_url
    with session_scope(url) as s:
        tenant = create_tenant(s, name)
        principal = authenticate(s, f"Bearer {create_key(s, tenant.id)[1]}")
        store = ArtifactStore(settings.resolved_artifact_root)
        add_chat_file(s, store, tenant.id, f"f-{name}", 2)
        req = JobCreateRequest.model_validate({"model": "tiny-llama", "training_file": f"f-{name}"})
        job = create_job(s, principal, req, ModelRegistry(settings.resolved_model_registry))
        return tenant.id, job.id


def _outbox(settings: Settings) -> list[WebhookDelivery]:
    with session_scope(settings.resolved_database_url) as s:
        rows = s.scalars(select(WebhookDelivery).order_by(WebhookDelivery.endpoint_id))
        return list(rows)


def test_a_jobs_end_is_in_the_outbox_for_each_subscribed_endpoint_of_its_tenant(
    settings: Settings,
) -> None:
    url = settings.resolved_database_url
    acme, job = _tenant_with_job(settings, "acme")
    other, _ = _tenant_with_job(settings, "other")
    with session_scope(url) as s:
        every = add_endpoint(s, acme, "https://acme.example/hooks", policy=PUBLIC).id
        failures = add_endpoint(
            s,
            acme,
            "http://127.0.0.1:9/f",
            events=[EVENTS[1]],
            policy=OutboundPolicy.from_allow(["127.0.0.1/32"]),
        ).id
        add_endpoint(s, other, "https://other.example/hooks", policy=PUBLIC)

    # A move that is not an end sends nothing.
    with session_scope(url) as s:
        transition(s, job, JobStatus.VALIDATING_FILES, JobStatus.QUEUED, "Files validated")
    assert _outbox(settings) == []

    # An end rolled back leaves nothing in the outbox: the two are one transaction.
    with session_factory(url)() as s:
        request_move(s, job, "cancel")
        assert len(s.scalars(select(WebhookDelivery)).all()) == 1
        s.rollback()
    assert _outbox(settings) == []

    with session_scope(url) as s:
        request_move(s, job, "cancel")
    [delivery] = _outbox(settings)
    assert delivery.endpoint_id == every != failures  # not the failures-only endpoint
    assert (delivery.type, delivery.job_id, delivery.status) == (
        "fine_tuning.job.cancelled",
        job,
        "pending",
    )
    assert delivery.payload == {
        "id": delivery.event_id,
        "object": "event",
        "created_at": delivery.created_at,
        "type": "fine_tuning.job.cancelled",
        "data": {"id": job},
    }


def test_deliveries_are_claimed_once_retried_on_schedule_and_given_up(
    settings: Settings,
) -> None:
    url = settings.resolved_database_url
    acme, job = _tenant_with_job(settings, "acme")
    with session_scope(url) as s:
        endpoint = add_endpoint(s, acme, "https://acme.example/hooks", policy=PUBLIC)
        transition(s, job, JobStatus.VALIDATING_FILES, JobStatus.FAILED, "Bad file")
    now = _outbox(settings)[0].next_attempt_at

    def claim(at: int) -> list[Any]:
        with session_scope(url) as s:
            return claim_due(s, now=at, timeout_s=TIMEOUT)

    def answer(delivery_id: str, at: int, code: int | None) -> str:
        with session_scope(url) as s:
            error = None if code and code < 300 else "refused"
            return record_attempt(
                s, delivery_id, now=at, status_code=code, error=error, ms=3, delays=DELAYS
            )

    [out] = claim(now)
    assert (out.url, out.secret) == ("https://acme.example/hooks", endpoint.secret)
    assert out.payload["type"] == "fine_tuning.job.failed"
    assert claim(now) == []  # claimed: not handed out twice
    assert answer(out.delivery_id, now, 500) == "pending"
    assert claim(now + DELAYS[0] - 1) == []
    [again] = claim(now + DELAYS[0])
    assert again.event_id == out.event_id  # the same webhook-id on every attempt
    assert answer(out.delivery_id, now + 10, None) == "pending"
    [last] = claim(now + 10 + DELAYS[1])
    assert answer(last.delivery_id, now + 70, 503) == "failed"  # past the last delay
    assert claim(now + 10_000) == []
    with session_scope(url) as s:
        [logged] = deliveries(s, endpoint.id)
        assert logged.attempts == 3
        assert [a["status_code"] for a in logged.log] == [500, None, 503]
        assert [a["at"] for a in logged.log] == [now, now + 10, now + 70]


def test_a_sender_that_dies_mid_send_leaves_its_delivery_due_again(settings: Settings) -> None:
    url = settings.resolved_database_url
    acme, job = _tenant_with_job(settings, "acme")
    with session_scope(url) as s:
        add_endpoint(s, acme, "https://acme.example/hooks", policy=PUBLIC)
        request_move(s, job, "cancel")
    now = _outbox(settings)[0].next_attempt_at
    with session_scope(url) as s:
        [claimed] = claim_due(s, now=now, timeout_s=TIMEOUT)
    # ... and its sender dies before it records the answer
    later = now + TIMEOUT + CLAIM_MARGIN_S
    with session_scope(url) as s:
        assert claim_due(s, now=later - 1, timeout_s=TIMEOUT) == []
        [again] = claim_due(s, now=later, timeout_s=TIMEOUT)
        assert again.delivery_id == claimed.delivery_id
        assert (
            record_attempt(
                s, again.delivery_id, now=now, status_code=204, error=None, ms=1, delays=DELAYS
            )
            == "delivered"
        )


def test_a_410_gone_stops_the_retries(settings: Settings) -> None:
    url = settings.resolved_database_url
    acme, job = _tenant_with_job(settings, "acme")
    with session_scope(url) as s:
        add_endpoint(s, acme, "https://acme.example/hooks", policy=PUBLIC)
        request_move(s, job, "cancel")
        [out] = claim_due(s, now=2**40, timeout_s=TIMEOUT)
        status = record_attempt(
            s, out.delivery_id, now=1, status_code=410, error="gone", ms=1, delays=DELAYS
        )
    assert status == "failed"


@pytest.mark.parametrize(
    ("url", "events", "says"),
    [
        ("ftp://acme.example/x", None, "'ftp://acme.example/x' is not an http(s) URL"),
        ("https:///nohost", None, "is not an http(s) URL with a host"),
        ("https://a.example/" + "x" * 2100, None, "is longer than 2048 characters"),
        ("http://127.0.0.1:5432/x", None, "'127.0.0.1' is a loopback address"),
        ("http://169.254.169.254/latest/meta-data", None, "is a link-local address"),
        ("http://[::1]:8000/", None, "'::1' is a loopback address"),
        ("http://[::ffff:127.0.0.1]/", None, "'::ffff:127.0.0.1' is a loopback address"),
        ("https://10.1.2.3/hooks", None, "'10.1.2.3' is a private address"),
        ("http://localhost:8265/api/jobs/", None, "'localhost' is this machine"),
        ("https://a.example", ["fine_tuning.job.started"], "['fine_tuning.job.started']"),
        ("https://a.example", [], "choose from fine_tuning.job.succeeded"),
    ],
)
def test_an_endpoint_refused_names_the_value_and_the_fix(
    settings: Settings, url: str, events: list[str] | None, says: str
) -> None:
    acme, _ = _tenant_with_job(settings, "acme")
    with session_scope(settings.resolved_database_url) as s, pytest.raises(InvalidRequest) as e:
        add_endpoint(s, acme, url, events=events, policy=PUBLIC)
    assert says in e.value.message
    assert e.value.param == ("url" if events is None else "events")
    if "address" in says or "machine" in says:
        assert "TUNEFLEET_OUTBOUND_ALLOW" in e.value.message  # the operator's fix


def test_an_operator_allows_internal_endpoints_by_cidr_or_host_name(settings: Settings) -> None:
    acme, _ = _tenant_with_job(settings, "acme")
    policy = OutboundPolicy.from_allow(["10.0.0.0/8", "hooks.localhost"])
    with session_scope(settings.resolved_database_url) as s:
        add_endpoint(s, acme, "https://10.1.2.3/hooks", policy=policy)
        add_endpoint(s, acme, "http://hooks.localhost:8000/", policy=policy)
        with pytest.raises(InvalidRequest, match=r"'10\.1\.2\.3'"):
            add_endpoint(s, acme, "https://10.1.2.3/hooks", policy=PUBLIC)
