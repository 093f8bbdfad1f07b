"""Controller leader election: one leader, renewal, takeover after the TTL, release, races.

Every test drives time with a fake clock, so nothing sleeps.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from tunefleet.platform.db import ControllerLease, session_scope
from tunefleet.platform.lease import Lease

TTL = 10.0


class FakeClock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _pair(url: str, clock: FakeClock) -> tuple[Lease, Lease]:
    return (
        Lease(url, holder="a", ttl_s=TTL, clock=clock),
        Lease(url, holder="b", ttl_s=TTL, clock=clock),
    )


def _row(url: str) -> ControllerLease:
    with session_scope(url) as s:
        row = s.get(ControllerLease, "controller")
        assert row is not None
        return row


def test_only_one_of_two_leads(migrated_url: str) -> None:
    a, b = _pair(migrated_url, FakeClock())
    assert a.acquire()
    assert not b.acquire()
    assert (a.is_leader, a.term) == (True, 1)
    assert (b.is_leader, b.term) == (False, None)
    assert _row(migrated_url).holder == "a"


def test_leader_renews_and_keeps_its_term(migrated_url: str) -> None:
    clock = FakeClock()
    a, b = _pair(migrated_url, clock)
    assert a.acquire()
    for _ in range(5):
        clock.now += TTL / 2  # renewing every half TTL keeps the lease well past one TTL
        assert a.acquire()
        assert not b.acquire()
    assert a.term == 1
    assert _row(migrated_url).expires_ms == int((clock.now + TTL) * 1000)


def test_standby_takes_over_after_the_ttl(migrated_url: str) -> None:
    clock = FakeClock()
    a, b = _pair(migrated_url, clock)
    assert a.acquire()
    clock.now += TTL / 2
    assert not b.acquire()  # not yet expired
    clock.now += TTL  # a missed its renewals
    assert b.acquire()
    assert b.term == 2
    assert not a.acquire()  # the deposed leader learns it on its next pass
    assert (a.is_leader, a.term) == (False, None)
    row = _row(migrated_url)
    assert (row.holder, row.term) == ("b", 2)


def test_expired_holder_that_nobody_replaced_keeps_its_term(migrated_url: str) -> None:
    clock = FakeClock()
    a, _ = _pair(migrated_url, clock)
    assert a.acquire()
    clock.now += 3 * TTL
    assert a.acquire()
    assert a.term == 1


def test_release_hands_over_at_once(migrated_url: str) -> None:
    clock = FakeClock()
    a, b = _pair(migrated_url, clock)
    assert a.acquire()
    assert not b.acquire()
    a.release()
    assert (a.is_leader, a.term) == (False, None)
    assert b.acquire()  # same instant, no TTL wait
    assert b.term == 2
    assert not a.acquire()


def test_release_by_a_non_holder_changes_nothing(migrated_url: str) -> None:
    a, b = _pair(migrated_url, FakeClock())
    assert a.acquire()
    b.release()
    assert not b.acquire()
    assert a.acquire()
    assert a.term == 1


def test_default_holders_differ_within_one_process(migrated_url: str) -> None:
    clock = FakeClock()
    a = Lease(migrated_url, clock=clock)
    b = Lease(migrated_url, clock=clock)
    assert a.holder != b.holder
    assert a.acquire()
    assert not b.acquire()


def test_bad_arguments_name_the_value(migrated_url: str) -> None:
    with pytest.raises(ValueError, match="ttl_s=0"):
        Lease(migrated_url, ttl_s=0)
    with pytest.raises(ValueError, match="holder"):
        Lease(migrated_url, holder="x" * 129)
    with pytest.raises(ValueError, match="name"):
        Lease(migrated_url, name="")


def _race(url: str, clock: FakeClock, n: int = 8) -> list[Lease]:
    leases = [Lease(url, ttl_s=TTL, clock=clock) for _ in range(n)]
    start = threading.Barrier(n)

    def attempt(lease: Lease) -> bool:
        start.wait()
        return lease.acquire()

    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(attempt, leases))
    assert results.count(True) == 1, results
    return [lease for lease in leases if lease.is_leader]


def test_concurrent_acquire_yields_exactly_one_leader(migrated_url: str) -> None:
    clock = FakeClock()
    # On an empty table every thread tries the insert; then on an expired row, the update.
    (first,) = _race(migrated_url, clock)
    assert first.term == 1
    clock.now += 2 * TTL
    (second,) = _race(migrated_url, clock)
    assert second.term == 2
    assert not first.acquire()
    assert _row(migrated_url).holder == second.holder
