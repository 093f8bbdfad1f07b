"""Sending the webhook outbox (``platform.webhooks``): each due delivery POSTed to its
endpoint, signed per the Standard Webhooks spec (the ``standardwebhooks`` package), its
answer written back. The controller's leader runs ``send_due`` on its own thread, once a
pass at most (``WebhookSender``), so a slow endpoint holds up no scheduling.

Headers: ``webhook-id`` (the event's id, the same on every attempt: receivers deduplicate
on it), ``webhook-timestamp`` (Unix seconds of this attempt) and ``webhook-signature``
(``v1,`` + base64 HMAC-SHA256 of ``id.timestamp.body`` with the endpoint's secret).
Redirects are not followed: a 3xx is a failed attempt, retried like any other.

Each attempt resolves the endpoint's host again and connects only to an address the
outbound policy allows (``platform.outbound.pinned_request``): an endpoint whose name now
resolves to a private or metadata address is refused before any connection, as a failed
attempt. What an endpoint answers is not kept beyond its status code: the delivery log,
which admins read, and this process's log hold "HTTP 500", never the body.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable
from concurrent import futures
from datetime import UTC, datetime

import httpx
from sqlalchemy.orm import Session
from standardwebhooks.webhooks import Webhook

from tunefleet.platform.db import now_s, session_scope
from tunefleet.platform.outbound import OutboundPolicy, OutboundRefused, pinned_request
from tunefleet.platform.settings import Settings
from tunefleet.platform.webhooks import Outgoing, any_due, claim_due, record_attempt

log = logging.getLogger(__name__)
USER_AGENT = "TuneFleet-Webhooks/1"


def signed_request(out: Outgoing, at: datetime) -> tuple[bytes, dict[str, str]]:
    """The body and headers of one attempt of ``out`` at ``at``."""
    body = json.dumps(out.payload, separators=(",", ":"))
    signature = Webhook(out.secret).sign(out.event_id, at, body)
    return body.encode(), {
        "content-type": "application/json",
        "user-agent": USER_AGENT,
        "webhook-id": out.event_id,
        "webhook-timestamp": str(int(at.timestamp())),
        "webhook-signature": signature,
    }


def send_due(
    reading: Callable[[], contextlib.AbstractContextManager[Session]],
    writing: Callable[[], contextlib.AbstractContextManager[Session]],
    client: httpx.Client,
    *,
    delays: tuple[float, ...],
    timeout_s: float,
    policy: OutboundPolicy,
    limit: int = 20,
) -> int:
    """Send the deliveries due now (at most ``limit``), one after another; how many were
    sent. ``reading`` opens a plain session (the look for due ones, every pass), ``writing``
    the controller's fenced one: a deposed leader's claims and answers are not written (its
    successor sends those deliveries again)."""
    with reading() as s:
        if not any_due(s, now=now_s()):
            return 0
    sent = 0
    while sent < limit:
        # one at a time: a claim lasts one send, so a sender's death delays one delivery
        # by a timeout at most
        with writing() as s:
            claimed = claim_due(s, now=now_s(), timeout_s=timeout_s)
        if not claimed:
            break
        send_one(claimed[0], writing, client, delays=delays, timeout_s=timeout_s, policy=policy)
        sent += 1
    return sent


def send_one(
    out: Outgoing,
    writing: Callable[[], contextlib.AbstractContextManager[Session]],
    client: httpx.Client,
    *,
    delays: tuple[float, ...],
    timeout_s: float,
    policy: OutboundPolicy,
) -> str:
    """One attempt of the claimed delivery ``out``, to an address ``policy`` allows; its
    status afterwards."""
    body, headers = signed_request(out, datetime.now(tz=UTC))
    start = time.perf_counter()
    code: int | None = None
    error: str | None = None
    try:
        answer = pinned_request(
            client.post,
            policy,
            out.url,
            what="webhook url",
            content=body,
            headers=headers,
            timeout=timeout_s,
        )
        code = answer.status_code
        if not 200 <= code < 300:
            error = f"HTTP {code}"
    except OutboundRefused as exc:
        error = f"refused: {exc}"
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"
    ms = int((time.perf_counter() - start) * 1000)
    with writing() as s:
        status = record_attempt(
            s, out.delivery_id, now=now_s(), status_code=code, error=error, ms=ms, delays=delays
        )
    if error:
        log.warning(
            "webhook %s (%s) to %s: %s; now %s",
            out.delivery_id, out.payload.get("type"), out.url, error, status,
        )  # fmt: skip
    return status


class WebhookSender:
    """The webhook outbox, sent on its own thread: a slow endpoint holds up no pass."""

    def __init__(
        self,
        settings: Settings,
        db_url: str,
        writing: Callable[[], contextlib.AbstractContextManager[Session]],
    ):
        self.settings = settings
        self.db_url = db_url
        self.writing = writing
        self._pool = futures.ThreadPoolExecutor(1, thread_name_prefix="webhooks")
        self._sending: futures.Future[int] | None = None
        self._http = httpx.Client(follow_redirects=False)

    def close(self) -> None:
        """Leave the sending thread without waiting for a send in progress."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def send(self) -> None:
        """Hand the outbox to the sending thread (``send_due``), unless its last send is
        still going."""
        if self._sending is not None:
            if not self._sending.done():
                return
            if (exc := self._sending.exception()) is not None:
                log.error("sending webhooks failed: %s", exc)
        self._sending = self._pool.submit(
            send_due,
            lambda: session_scope(self.db_url),
            self.writing,
            self._http,
            delays=self.settings.webhook_retry_delays_s,
            timeout_s=self.settings.webhook_timeout_s,
            policy=self.settings.outbound_policy,
        )
