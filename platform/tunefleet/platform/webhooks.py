"""Webhooks: tenants' endpoints, and the outbox of what is sent to them.

A job's end (``succeeded``, ``failed``, ``cancelled``) is written by ``status.transition``;
in the same transaction ``enqueue`` adds one outbox row (``WebhookDelivery``) per endpoint
of the job's tenant that asked for that event. So an end is never recorded without its
deliveries, nor a delivery without its end, whoever wrote the end (the controller, or the
API for a cancel). The controller's leader sends them (``workers/_webhook_sender.py``):
``claim_due`` takes a row due and puts it off until its send has timed out (a sender that
dies mid-send leaves it due again then), ``record_attempt`` writes the answer: delivered on a
2xx, else due again after the next of ``Settings.webhook_retry_delays_s``, failed after
the last (or at once on a 410 Gone, the spec's "stop sending"). The rows are the state:
deliveries survive restarts and fail-overs, and each attempt is in the row's ``log``.

The events are OpenAI's, in its payload shape: ``{"id": "evt-...", "object": "event",
"created_at": ..., "type": "fine_tuning.job.succeeded", "data": {"id": "ftjob-..."}}``.
A receiver fetches the job for the rest. Signing (Standard Webhooks: ``webhook-id``,
``webhook-timestamp``, ``webhook-signature`` over ``id.timestamp.body``) is the sender's.
"""

from __future__ import annotations

import base64
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from tunefleet.platform import audit
from tunefleet.platform.audit import Actor
from tunefleet.platform.db import Job, WebhookDelivery, WebhookEndpoint, now_s
from tunefleet.platform.errors import InvalidRequest, NotFound
from tunefleet.platform.ids import new_id
from tunefleet.platform.outbound import OutboundPolicy, OutboundRefused

EVENTS = ("fine_tuning.job.succeeded", "fine_tuning.job.failed", "fine_tuning.job.cancelled")
# A claimed delivery is due again this long past its send's timeout, if its sender died.
CLAIM_MARGIN_S = 15
MAX_URL = 2048


def new_secret() -> str:
    """A signing secret in Standard Webhooks' form: ``whsec_`` and 24 random bytes in
    base64."""
    return "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()


def _check_url(url: str, policy: OutboundPolicy) -> str:
    if len(url) > MAX_URL:
        raise InvalidRequest(
            f"webhook url {url[:200]!r}... is longer than {MAX_URL} characters; give a "
            "shorter one such as https://example.com/tunefleet",
            param="url",
        )
    try:
        policy.check_url(url, what="webhook url")
    except OutboundRefused as exc:
        raise InvalidRequest(str(exc), param="url") from None
    return url


def _check_events(events: Sequence[str] | None) -> list[str]:
    if events is None:
        return list(EVENTS)
    unknown = [e for e in events if e not in EVENTS]
    if unknown or not events:
        raise InvalidRequest(
            f"webhook events {unknown or list(events)} are not ones TuneFleet sends; choose "
            f"from {', '.join(EVENTS)} (or leave events out for all)",
            param="events",
        )
    return list(dict.fromkeys(events))


def add_endpoint(
    session: Session,
    tenant_id: str,
    url: str,
    *,
    events: Sequence[str] | None = None,
    description: str = "",
    policy: OutboundPolicy,
    actor: Actor | None = None,
) -> WebhookEndpoint:
    """A new endpoint of the tenant for ``events`` (all when None), with a new secret; its
    URL one ``policy`` (``Settings.outbound_policy``) may allow: its host is checked
    again at each delivery."""
    endpoint = WebhookEndpoint(
        id=new_id("webhook"),
        tenant_id=tenant_id,
        url=_check_url(url, policy),
        secret=new_secret(),
        events=_check_events(events),
        description=description,
        created_at=now_s(),
    )
    session.add(endpoint)
    session.flush()
    if actor is not None:
        audit.record(
            session,
            actor,
            "webhook.create",
            target_type="webhook",
            target_id=endpoint.id,
            tenant_id=tenant_id,
            after={"url": url, "events": endpoint.events},
        )
    return endpoint


def list_endpoints(session: Session, tenant_id: str) -> list[WebhookEndpoint]:
    return list(
        session.scalars(
            select(WebhookEndpoint)
            .where(WebhookEndpoint.tenant_id == tenant_id)
            .order_by(WebhookEndpoint.created_at, WebhookEndpoint.id)
        )
    )


def get_endpoint(session: Session, endpoint_id: str) -> WebhookEndpoint:
    endpoint = session.get(WebhookEndpoint, endpoint_id)
    if endpoint is None:
        raise NotFound(f"no webhook endpoint with id {endpoint_id!r}", param="endpoint_id")
    return endpoint


def remove_endpoint(
    session: Session, endpoint_id: str, *, actor: Actor | None = None
) -> WebhookEndpoint:
    """Delete the endpoint and its deliveries (sent or not); recorded as ``actor``'s act
    when given."""
    endpoint = get_endpoint(session, endpoint_id)
    session.delete(endpoint)
    session.flush()
    if actor is not None:
        audit.record(
            session,
            actor,
            "webhook.delete",
            target_type="webhook",
            target_id=endpoint.id,
            tenant_id=endpoint.tenant_id,
            before={"url": endpoint.url, "events": endpoint.events},
        )
    return endpoint


def deliveries(session: Session, endpoint_id: str, limit: int = 50) -> list[WebhookDelivery]:
    """The endpoint's deliveries, newest first: the delivery log."""
    get_endpoint(session, endpoint_id)
    return list(
        session.scalars(
            select(WebhookDelivery)
            .where(WebhookDelivery.endpoint_id == endpoint_id)
            .order_by(WebhookDelivery.created_at.desc(), WebhookDelivery.id.desc())
            .limit(limit)
        )
    )


def enqueue(session: Session, job_id: str, status: str) -> int:
    """Add the deliveries of job ``job_id``'s end in ``status`` to the outbox, in the
    caller's transaction (``status.transition`` calls it); how many."""
    kind = f"fine_tuning.job.{status}"
    if kind not in EVENTS:
        return 0
    endpoints = session.execute(
        select(WebhookEndpoint.id, WebhookEndpoint.events)
        .join(Job, Job.tenant_id == WebhookEndpoint.tenant_id)
        .where(Job.id == job_id)
    ).all()
    wanted = [e.id for e in endpoints if kind in e.events]
    if not wanted:
        return 0
    now, event_id = now_s(), new_id("webhook_event")
    payload = {
        "id": event_id,
        "object": "event",
        "created_at": now,
        "type": kind,
        "data": {"id": job_id},
    }
    for endpoint_id in wanted:
        session.add(
            WebhookDelivery(
                id=new_id("delivery"),
                endpoint_id=endpoint_id,
                job_id=job_id,
                event_id=event_id,
                type=kind,
                payload=payload,
                status="pending",
                attempts=0,
                next_attempt_at=now,
                log=[],
                created_at=now,
            )
        )
    return len(wanted)


@dataclass(frozen=True)
class Outgoing:
    """A claimed delivery: what the sender needs, read in the claim's transaction."""

    delivery_id: str
    url: str
    secret: str
    event_id: str
    payload: dict[str, Any]


def any_due(session: Session, *, now: int) -> bool:
    """Whether a delivery is due at ``now`` (a read: the sender claims only then)."""
    return (
        session.scalar(
            select(WebhookDelivery.id)
            .where(WebhookDelivery.status == "pending", WebhookDelivery.next_attempt_at <= now)
            .limit(1)
        )
        is not None
    )


def claim_due(session: Session, *, now: int, timeout_s: float, limit: int = 1) -> list[Outgoing]:
    """Take up to ``limit`` deliveries due at ``now``, oldest due first, putting each off
    until its send has timed out (``timeout_s`` and ``CLAIM_MARGIN_S``): a compare-and-set,
    so two senders never take one row at once."""
    due = session.execute(
        select(WebhookDelivery, WebhookEndpoint.url, WebhookEndpoint.secret)
        .join(WebhookEndpoint, WebhookEndpoint.id == WebhookDelivery.endpoint_id)
        .where(WebhookDelivery.status == "pending", WebhookDelivery.next_attempt_at <= now)
        .order_by(WebhookDelivery.next_attempt_at, WebhookDelivery.id)
        .limit(limit)
    ).all()
    claimed = []
    for delivery, url, secret in due:
        taken = session.execute(
            update(WebhookDelivery)
            .where(
                WebhookDelivery.id == delivery.id,
                WebhookDelivery.status == "pending",
                WebhookDelivery.next_attempt_at == delivery.next_attempt_at,
            )
            .values(next_attempt_at=now + int(timeout_s) + CLAIM_MARGIN_S)
            .execution_options(synchronize_session=False)
        )
        if taken.rowcount == 1:  # type: ignore[attr-defined]
            claimed.append(
                Outgoing(delivery.id, url, secret, delivery.event_id, dict(delivery.payload))
            )
    return claimed


def record_attempt(
    session: Session,
    delivery_id: str,
    *,
    now: int,
    status_code: int | None,
    error: str | None,
    ms: int,
    delays: Sequence[float],
) -> str:
    """Write one attempt's answer (``status_code``, or ``error`` when none came) on the
    delivery; its status afterwards: ``delivered``, ``pending`` (due again after the next
    delay) or ``failed``. A delivery deleted meanwhile (its endpoint removed) is ``gone``."""
    delivery = session.get(WebhookDelivery, delivery_id)
    if delivery is None:
        return "gone"
    attempts = delivery.attempts + 1
    entry: dict[str, Any] = {"at": now, "status_code": status_code, "ms": ms}
    if error:
        entry["error"] = error[:500]
    delivery.attempts = attempts
    delivery.log = [*delivery.log, entry]
    if status_code is not None and 200 <= status_code < 300:
        delivery.status, delivery.delivered_at = "delivered", now
    elif status_code == 410 or attempts > len(delays):
        delivery.status = "failed"
    else:
        delivery.next_attempt_at = now + int(delays[attempts - 1])
    return delivery.status


def endpoint_view(endpoint: WebhookEndpoint, *, with_secret: bool = False) -> dict[str, Any]:
    view = {
        "id": endpoint.id,
        "object": "webhook_endpoint",
        "tenant_id": endpoint.tenant_id,
        "url": endpoint.url,
        "events": endpoint.events,
        "description": endpoint.description,
        "created_at": endpoint.created_at,
    }
    if with_secret:
        view["secret"] = endpoint.secret
    return view


def delivery_view(delivery: WebhookDelivery) -> dict[str, Any]:
    return {
        "id": delivery.id,
        "object": "webhook_delivery",
        "endpoint_id": delivery.endpoint_id,
        "event_id": delivery.event_id,
        "type": delivery.type,
        "job_id": delivery.job_id,
        "status": delivery.status,
        "attempts": delivery.attempts,
        "next_attempt_at": delivery.next_attempt_at if delivery.status == "pending" else None,
        "created_at": delivery.created_at,
        "delivered_at": delivery.delivered_at,
        "log": delivery.log,
    }
