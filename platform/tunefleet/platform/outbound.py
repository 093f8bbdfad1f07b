"""Where TuneFleet's outbound requests may go: one policy for every address a tenant names
(webhook endpoints, MLflow tracking servers) and any later outbound call.

An address is refused unless it is public: loopback, private (RFC 1918, unique local),
link-local (so the cloud's metadata service, 169.254.169.254 and fd00:ec2::254), shared
(100.64.0.0/10), multicast, reserved and unspecified addresses are all refused, IPv4
inside IPv6 (``::ffff:127.0.0.1``) by its IPv4 address. The operator allows more with
``Settings.outbound_allow``: host names (allowed whatever they resolve to: the operator
vouches for their DNS) and CIDRs (an internal MLflow at 10.0.3.7 is ``10.0.3.7/32``).

Checked twice:

- ``check_url`` when the address is given (a job created, a webhook added): the scheme,
  and a host that is an IP literal or ``localhost``, with no DNS lookup (a name may not
  resolve from the API's network, and what it resolves to then proves nothing later);
- ``resolve`` when a request is made: every address the name resolves to *now* must be
  allowed, and the caller connects to one of those (``pinned_request`` for httpx,
  ``guard_resolution`` for libraries that resolve for themselves). So a name that
  resolved to a public address at creation and to 127.0.0.1 at delivery (DNS rebinding)
  is refused, before any connection is made.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import SplitResult, urlsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

SETTING = "TUNEFLEET_OUTBOUND_ALLOW"


class OutboundRefused(ValueError):
    """An outbound address the policy refuses; the message names it and the setting that
    would allow it."""


def _name(host: str) -> str:
    """A host name as compared: lower case, without DNS's trailing dot."""
    return host.lower().rstrip(".")


def _unmapped(ip: IPAddress) -> IPAddress:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


@dataclass(frozen=True)
class OutboundPolicy:
    """Public addresses, plus the operator's ``hosts`` and ``networks``."""

    hosts: frozenset[str] = frozenset()
    networks: tuple[IPNetwork, ...] = field(default=())

    @classmethod
    def from_allow(cls, allow: Iterable[str]) -> OutboundPolicy:
        """From ``Settings.outbound_allow``: each entry a CIDR (or a single address) or a
        host name."""
        hosts: set[str] = set()
        networks: list[IPNetwork] = []
        for entry in allow:
            entry = entry.strip()
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                if not entry or "/" in entry or ":" in entry:
                    raise ValueError(
                        f"{SETTING} entry {entry!r} is neither a CIDR such as 10.0.0.0/8 nor "
                        "a host name such as mlflow.internal"
                    ) from None
                hosts.add(_name(entry))
        return cls(frozenset(hosts), tuple(networks))

    def address_allowed(self, ip: IPAddress) -> bool:
        ip = _unmapped(ip)
        if any(ip in net for net in self.networks):
            return True
        return ip.is_global and not ip.is_multicast

    def host_allowed(self, host: str) -> bool:
        """Whether ``host`` (a name) is on the operator's list."""
        return _name(host) in self.hosts

    def check_url(self, url: str, *, what: str, param: str | None = None) -> SplitResult:
        """``url``'s parts if it is an http(s) URL whose host may be allowed; raises
        ``OutboundRefused`` naming ``what`` (e.g. "webhook url") otherwise. Names other
        than ``localhost`` are checked when the request is made (``resolve``)."""
        parts = urlsplit(url)
        try:
            host, port = parts.hostname, parts.port
        except ValueError:
            host = port = None
        if parts.scheme not in ("http", "https") or not host:
            raise OutboundRefused(
                f"{what} {url[:200]!r} is not an http(s) URL with a host; give one such as "
                "https://example.com/path"
            )
        del port
        if self.host_allowed(host):
            return parts
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            if _name(host) == "localhost" or _name(host).endswith(".localhost"):
                raise self._refused(what, host, "is this machine") from None
            return parts
        if not self.address_allowed(ip):
            raise self._refused(what, host, f"is {_kind(ip)}")
        return parts

    def resolve(self, host: str, port: int, *, what: str) -> list[IPAddress]:
        """The addresses ``host`` resolves to now, each one allowed (a name on the
        operator's list: whatever they are); ``OutboundRefused`` if any is not, or if it
        resolves to none."""
        try:
            infos = _getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise OutboundRefused(f"{what} host {host!r} does not resolve: {exc}") from None
        return self.check_resolved(host, infos, what=what)

    def check_resolved(self, host: str, infos: list[Any], *, what: str) -> list[IPAddress]:
        """The addresses of ``infos`` (what ``socket.getaddrinfo`` gave for ``host``),
        each one allowed; ``OutboundRefused`` if any is not, or if there are none."""
        addresses = list(
            dict.fromkeys(ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos)
        )
        if not addresses:
            raise OutboundRefused(f"{what} host {host!r} resolves to no address")
        if not self.host_allowed(host):
            for ip in addresses:
                if not self.address_allowed(ip):
                    is_ = f"is {_kind(ip)}" if host == str(ip) else f"resolves to {ip}, {_kind(ip)}"
                    raise self._refused(what, host, is_)
        return addresses

    @staticmethod
    def _refused(what: str, host: str, is_: str) -> OutboundRefused:
        return OutboundRefused(
            f"{what} host {host!r} {is_}, where TuneFleet sends nothing unless the "
            f"operator allows it ({SETTING}: a host name, or a CIDR such as 10.0.0.0/8); "
            "give a public address"
        )


# Public addresses only: the policy with nothing allowed by the operator.
PUBLIC_ONLY = OutboundPolicy()


def _kind(ip: IPAddress) -> str:
    ip = _unmapped(ip)
    if ip.is_loopback:
        return "a loopback address"
    if ip.is_link_local:
        return "a link-local address (the cloud's metadata service is one)"
    if ip.is_private:
        return "a private address"
    if ip.is_multicast:
        return "a multicast address"
    return "not a public address"


# socket.getaddrinfo as Python has it: what guard_resolution puts back, and what the
# checks look names up with (tests replace the latter to make a name resolve elsewhere).
_system_getaddrinfo = _getaddrinfo = socket.getaddrinfo
_guard_lock = threading.Lock()
_guards = 0  # guards active in this process: socket.getaddrinfo is wrapped while any is
_guarded = threading.local()  # .hosts: this thread's guarded hosts -> (policy, what)


def _guarded_getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
    key = host.decode() if isinstance(host, bytes) else host
    hosts: dict[str, tuple[OutboundPolicy, str]] = getattr(_guarded, "hosts", {})
    entry = hosts.get(_name(str(key))) if key is not None else None
    infos = _getaddrinfo(host, port, *args, **kwargs)
    if entry is not None:
        policy, what = entry
        policy.check_resolved(str(key), infos, what=what)  # what is connected to: no second lookup
    return infos


@contextmanager
def guard_resolution(policy: OutboundPolicy, hosts: dict[str, str]) -> Iterator[None]:
    """While inside, every name lookup *this thread* makes for one of ``hosts`` (host ->
    what it is, e.g. "mlflow tracking_uri") is checked by ``policy`` first: for libraries
    that open their own connections in the caller's thread (MLflow's client, ``requests``),
    the check happens at each connection, not once. Other threads (the run's checkpoint
    uploads, W&B's) look names up as before, whatever host they name. A check refused
    raises ``OutboundRefused`` from the lookup (not an ``OSError``: callers' retries on
    network errors would retry it)."""
    global _guards
    previous = getattr(_guarded, "hosts", {})
    _guarded.hosts = {
        **previous,
        **{_name(host): (policy, what) for host, what in hosts.items()},
    }
    with _guard_lock:
        _guards += 1
        socket.getaddrinfo = _guarded_getaddrinfo
    try:
        yield
    finally:
        _guarded.hosts = previous
        with _guard_lock:
            _guards -= 1
            if not _guards:
                socket.getaddrinfo = _system_getaddrinfo


def pinned_request(
    send: Callable[..., Any], policy: OutboundPolicy, url: str, *, what: str, **kwargs: Any
) -> Any:
    """``send(method_url, **kwargs)`` (an httpx client's ``post``, say) to ``url``,
    connected to an address ``policy.resolve`` allowed just now rather than to whatever
    the name resolves to at connect time: the URL names that address, the ``Host`` header
    and TLS (SNI and the certificate's check) the original name."""
    parts = policy.check_url(url, what=what)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    ip = policy.resolve(host, port, what=what)[0]
    netloc = f"[{ip}]" if ip.version == 6 else str(ip)
    if parts.port:
        netloc += f":{parts.port}"
    headers = {**kwargs.pop("headers", {}), "host": parts.netloc.rsplit("@", 1)[-1]}
    extensions = {**kwargs.pop("extensions", {}), "sni_hostname": host}
    return send(
        parts._replace(netloc=netloc).geturl(), headers=headers, extensions=extensions, **kwargs
    )
