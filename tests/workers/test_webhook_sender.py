"""The webhook sender (``workers/_webhook_sender.py``) against a real HTTP receiver on
127.0.0.1 that checks every signature with the ``standardwebhooks`` package: a delivery
refused is retried with the same webhook-id and a fresh signature, and logged; one
accepted is sent no more."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from sqlalchemy import select

from tunefleet.platform.db import Job, Tenant, WebhookDelivery, session_scope
from tunefleet.platform.settings import Settings
from tunefleet.platform.status import request_move
from tunefleet.platform.tenants import create_tenant
from tunefleet.platform.webhooks import add_endpoint
from tunefleet.workers._webhook_sender import send_due
from webhook_receiver import Receiver


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.stop()


def _cancelled_job(settings: Settings, receiver: Receiver) -> str:
    """A tenant with an endpoint at ``receiver`` and a job of it, cancelled."""
    url = settings.resolved_database_url
    with session_scope(url) as s:
        tenant = create_tenant(s, "acme")
        receiver.secret = add_endpoint(s, tenant.id, receiver.url).secret
        job = Job(
            id="ftjob-hooked",
            tenant_id=tenant.id,
            status="queued",
            model="tiny-llama",
            training_file="file-x",
            spec={},
        )
        s.add(job)
        s.flush()
        request_move(s, job.id, "cancel")
    return job.id


def test_a_refused_delivery_is_retried_signed_afresh_and_logged(
    settings: Settings, receiver: Receiver
) -> None:
    url = settings.resolved_database_url
    job_id = _cancelled_job(settings, receiver)
    receiver.answers = [503]

    def send() -> int:
        with httpx.Client() as client:
            return send_due(
                lambda: session_scope(url),
                lambda: session_scope(url),
                client,
                delays=(0, 0),
                timeout_s=5,
            )

    # refused, due again at once (a delay of 0 s) and accepted: two attempts
    assert send() == 2
    assert send() == 0  # nothing left
    first, second = receiver.got
    assert first["valid"] and second["valid"]
    assert first["headers"]["webhook-id"] == second["headers"]["webhook-id"]
    assert first["headers"]["webhook-signature"].startswith("v1,")
    assert first["body"] == second["body"]
    assert first["body"]["type"] == "fine_tuning.job.cancelled"
    assert first["body"]["data"] == {"id": job_id}
    assert first["body"]["id"] == first["headers"]["webhook-id"]
    with session_scope(url) as s:
        [delivery] = s.scalars(select(WebhookDelivery)).all()
        assert (delivery.status, delivery.attempts) == ("delivered", 2)
        assert [a["status_code"] for a in delivery.log] == [503, 200]
        assert "HTTP 503" in delivery.log[0]["error"]


def test_a_receiver_that_is_away_is_logged_as_such_and_given_up_after_the_last_retry(
    settings: Settings, receiver: Receiver
) -> None:
    url = settings.resolved_database_url
    _cancelled_job(settings, receiver)
    receiver.stop()
    with httpx.Client() as client:
        for _ in range(3):
            send_due(
                lambda: session_scope(url),
                lambda: session_scope(url),
                client,
                delays=(0, 0),
                timeout_s=2,
            )
    with session_scope(url) as s:
        [delivery] = s.scalars(select(WebhookDelivery)).all()
        tenant = s.scalars(select(Tenant)).one()
        assert tenant.name == "acme"
        assert (delivery.status, delivery.attempts) == ("failed", 3)
        assert all(a["status_code"] is None and "ConnectError" in a["error"] for a in delivery.log)
