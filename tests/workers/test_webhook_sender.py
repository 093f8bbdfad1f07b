"""The webhook sender (``workers/_webhook_sender.py``) against a real HTTP receiver on
127.0.0.1 that checks every signature with the ``standardwebhooks`` package: a delivery
refused is retried with the same webhook-id and a fresh signature, and logged; one
accepted is sent no more."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator

import httpx
import pytest
from sqlalchemy import select

from tunefleet.platform import outbound
from tunefleet.platform.db import Job, Tenant, WebhookDelivery, session_scope
from tunefleet.platform.outbound import OutboundPolicy
from tunefleet.platform.settings import Settings
from tunefleet.platform.status import request_move
from tunefleet.platform.tenants import create_tenant
from tunefleet.platform.webhooks import add_endpoint
from tunefleet.workers._webhook_sender import send_due
from webhook_receiver import Receiver

# the receiver is on this machine: allowed as an operator would allow an internal endpoint
LOCAL = OutboundPolicy.from_allow(["127.0.0.1/32"])


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.stop()


def _cancelled_job(settings: Settings, receiver: Receiver, url: str | None = None) -> str:
    """A tenant with an endpoint at ``receiver`` (or ``url``) and a job of it, cancelled."""
    db = settings.resolved_database_url
    with session_scope(db) as s:
        tenant = create_tenant(s, "acme")
        receiver.secret = add_endpoint(s, tenant.id, url or receiver.url, policy=LOCAL).secret
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


def _send(settings: Settings, policy: OutboundPolicy = LOCAL, timeout_s: float = 5) -> int:
    url = settings.resolved_database_url
    with httpx.Client() as client:
        return send_due(
            lambda: session_scope(url),
            lambda: session_scope(url),
            client,
            delays=(0, 0),
            timeout_s=timeout_s,
            policy=policy,
        )


def _log(settings: Settings) -> list[dict[str, object]]:
    with session_scope(settings.resolved_database_url) as s:
        [delivery] = s.scalars(select(WebhookDelivery)).all()
        return list(delivery.log)


def test_a_refused_delivery_is_retried_signed_afresh_and_logged(
    settings: Settings, receiver: Receiver
) -> None:
    url = settings.resolved_database_url
    job_id = _cancelled_job(settings, receiver)
    receiver.answers = [503]
    receiver.reply = b"internal detail the endpoint's owner never meant to share"

    def send() -> int:
        return _send(settings)

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
        # the status, never the body: the log is shown to admins, and the policy's point
        # is that no reply's content travels back
        assert delivery.log[0]["error"] == "HTTP 503"


def test_a_receiver_that_is_away_is_logged_as_such_and_given_up_after_the_last_retry(
    settings: Settings, receiver: Receiver
) -> None:
    url = settings.resolved_database_url
    _cancelled_job(settings, receiver)
    receiver.stop()
    for _ in range(3):
        _send(settings, timeout_s=2)
    with session_scope(url) as s:
        [delivery] = s.scalars(select(WebhookDelivery)).all()
        tenant = s.scalars(select(Tenant)).one()
        assert tenant.name == "acme"
        assert (delivery.status, delivery.attempts) == ("failed", 3)
        assert all(a["status_code"] is None and "ConnectError" in a["error"] for a in delivery.log)


@pytest.mark.parametrize(
    ("resolves_to", "kind"),
    [
        ("127.0.0.1", "a loopback address"),
        ("169.254.169.254", "a link-local address (the cloud's metadata service is one)"),
        ("::1", "a loopback address"),
        ("10.20.30.40", "a private address"),
        ("::ffff:127.0.0.1", "a loopback address"),
    ],
)
def test_a_name_that_resolves_to_a_non_public_address_at_delivery_is_refused_unconnected(
    settings: Settings,
    receiver: Receiver,
    monkeypatch: pytest.MonkeyPatch,
    resolves_to: str,
    kind: str,
) -> None:
    """DNS rebinding: a name, public when the endpoint was added (names are not resolved
    then), resolves to a non-public address at delivery. The attempt is refused before any
    connection: the receiver, listening on 127.0.0.1 at the URL's port, gets nothing."""
    port = receiver.url.split(":")[2].split("/")[0]
    _cancelled_job(settings, receiver, f"http://hooks.acme.example:{port}/hooks")
    real = outbound._getaddrinfo

    def rebound(host: str, *args: object, **kwargs: object) -> object:
        if host == "hooks.acme.example":
            return real(resolves_to, *args, **kwargs)  # type: ignore[arg-type]
        return real(host, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(outbound, "_getaddrinfo", rebound)
    # refused like an endpoint away: retried (the name may resolve elsewhere again, the
    # operator may allow it), here at once, then given up
    assert _send(settings, OutboundPolicy()) == 3
    assert receiver.got == []
    attempts = _log(settings)
    assert [a["status_code"] for a in attempts] == [None] * 3
    assert {a["error"] for a in attempts} == {
        f"refused: webhook url host 'hooks.acme.example' resolves to "
        f"{ipaddress.ip_address(resolves_to)}, {kind}, "
        "where TuneFleet sends "
        "nothing unless the operator allows it (TUNEFLEET_OUTBOUND_ALLOW: a host name, or a "
        "CIDR such as 10.0.0.0/8); give a public address"
    }


def test_an_endpoint_added_while_allowed_is_refused_at_delivery_once_the_operator_removes_it(
    settings: Settings, receiver: Receiver
) -> None:
    _cancelled_job(settings, receiver)
    assert _send(settings, OutboundPolicy()) == 3
    assert receiver.got == []
    assert all(
        str(a["error"]).startswith("refused: webhook url host '127.0.0.1' is a loopback")
        for a in _log(settings)
    )


def test_an_allowed_name_is_connected_to_the_address_checked_with_its_own_host_header(
    settings: Settings, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The attempt goes to the address the check resolved, and the receiver sees the URL's
    own host in ``Host``: the connection is pinned, not resolved a second time."""
    port = receiver.url.split(":")[2].split("/")[0]
    _cancelled_job(settings, receiver, f"http://hooks.internal:{port}/hooks")
    real = outbound._getaddrinfo
    looked_up: list[str] = []

    def internal(host: str, *args: object, **kwargs: object) -> object:
        looked_up.append(host)
        return real("127.0.0.1" if host == "hooks.internal" else host, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(outbound, "_getaddrinfo", internal)
    assert _send(settings, OutboundPolicy.from_allow(["hooks.internal"])) == 1
    [got] = receiver.got
    assert got["valid"] and got["headers"]["host"] == f"hooks.internal:{port}"
    assert looked_up == ["hooks.internal"]  # once: by the check, not again to connect
