"""The outbound policy (``platform/outbound.py``) on its own: which addresses are public,
what the operator's allowlist adds, and how a request is pinned to the address checked.
The webhook sender's and the trackers' tests run it against real servers on 127.0.0.1."""

from __future__ import annotations

import ipaddress
import socket
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tunefleet.platform import outbound
from tunefleet.platform.outbound import OutboundPolicy, OutboundRefused, guard_resolution
from tunefleet.platform.outbound import pinned_request as pinned


@pytest.mark.parametrize(
    ("address", "allowed"),
    [
        ("8.8.8.8", True),
        ("2606:4700:4700::1111", True),
        ("127.0.0.1", False),
        ("127.8.9.10", False),
        ("::1", False),
        ("10.0.0.1", False),
        ("172.16.5.4", False),
        ("192.168.0.1", False),
        ("169.254.169.254", False),  # the metadata service of AWS, GCP, Azure
        ("fd00:ec2::254", False),  # AWS's IPv6 one (unique local)
        ("fe80::1", False),
        ("100.64.0.1", False),  # carrier-grade NAT, shared
        ("0.0.0.0", False),
        ("224.0.0.1", False),
        ("::ffff:127.0.0.1", False),  # IPv4 in IPv6: judged by its IPv4 address
        ("::ffff:8.8.8.8", True),
    ],
)
def test_only_public_addresses_are_allowed_by_default(address: str, allowed: bool) -> None:
    assert OutboundPolicy().address_allowed(ipaddress.ip_address(address)) is allowed


def test_the_operator_allows_networks_and_host_names() -> None:
    policy = OutboundPolicy.from_allow(["10.0.3.7", "fd00::/8", "MLflow.Internal."])
    assert policy.address_allowed(ipaddress.ip_address("10.0.3.7"))
    assert not policy.address_allowed(ipaddress.ip_address("10.0.3.8"))
    assert policy.address_allowed(ipaddress.ip_address("fd00:ec2::254"))
    assert policy.host_allowed("mlflow.internal")
    for entry in ("", "http://x", "a/b"):
        with pytest.raises(ValueError, match="TUNEFLEET_OUTBOUND_ALLOW entry"):
            OutboundPolicy.from_allow([entry])


def test_a_url_is_checked_without_dns_when_given_and_with_it_when_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    policy = OutboundPolicy()
    looked_up: list[str] = []
    real = outbound._getaddrinfo

    def lookup(host: str, *args: Any, **kwargs: Any) -> Any:
        looked_up.append(host)
        return real("127.0.0.1" if host == "rebind.example" else host, *args, **kwargs)

    monkeypatch.setattr(outbound, "_getaddrinfo", lookup)
    policy.check_url("https://rebind.example/x", what="webhook url")  # names pass here
    assert looked_up == []
    with pytest.raises(OutboundRefused, match=r"resolves to 127\.0\.0\.1, a loopback address"):
        policy.resolve("rebind.example", 443, what="webhook url")
    with pytest.raises(OutboundRefused, match="is not an http"):
        policy.check_url("gopher://example.com", what="webhook url")
    # an allowed name is trusted whatever it resolves to
    allowed = OutboundPolicy.from_allow(["rebind.example"])
    assert allowed.resolve("rebind.example", 443, what="x") == [ipaddress.ip_address("127.0.0.1")]


def test_a_request_is_pinned_to_the_address_checked_with_the_names_host_and_tls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def lookup(host: str, port: int, *args: Any, **kwargs: Any) -> Any:
        address = {"v4.example": "93.184.216.34", "v6.example": "2606:2800:220:1::1"}[host]
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        return [(family, socket.SOCK_STREAM, 6, "", (address, port))]

    monkeypatch.setattr(outbound, "_getaddrinfo", lookup)
    sent: list[tuple[str, dict[str, Any]]] = []

    def send(url: str, **kwargs: Any) -> str:
        sent.append((url, kwargs))
        return "answer"

    policy = OutboundPolicy()
    assert pinned(send, policy, "https://v4.example/hooks?x=1", what="w", content=b"{}") == "answer"
    assert pinned(send, policy, "http://v6.example:8080/h", what="w", headers={"a": "b"})
    (v4, v4_args), (v6, v6_args) = sent
    assert v4 == "https://93.184.216.34/hooks?x=1"
    assert v4_args["headers"] == {"host": "v4.example"} and v4_args["content"] == b"{}"
    assert v4_args["extensions"] == {"sni_hostname": "v4.example"}
    assert v6 == "http://[2606:2800:220:1::1]:8080/h"
    assert v6_args["headers"] == {"a": "b", "host": "v6.example:8080"}


def test_the_resolution_guard_checks_only_its_hosts_in_its_thread_and_leaves_nothing_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with guard_resolution(OutboundPolicy(), {"localhost": "mlflow tracking_uri"}):
        with pytest.raises(OutboundRefused, match="'localhost' resolves to"):
            socket.getaddrinfo("localhost", 80)
        assert socket.getaddrinfo("127.0.0.1", 80)  # not a guarded host: as before
        # another thread of the process (a checkpoint upload, W&B's) is not held to it
        with ThreadPoolExecutor(1) as pool:
            assert pool.submit(socket.getaddrinfo, "localhost", 80).result()
    assert socket.getaddrinfo is outbound._system_getaddrinfo
    assert socket.getaddrinfo("localhost", 80)
