"""Per-tenant inference limits: requests per second and requests in flight. The state is
in the database, so the limits hold across API processes and replicas; each API process
takes its allowance from there in grants, so that most requests cost no database trip.

Rate: GCRA, the generic cell rate algorithm (ATM's, and redis-cell's). One row per tenant
holds the theoretical arrival time (TAT) of its next request. With ``rate`` requests per
second, the emission interval is ``T = 1 / rate``, and a burst of ``burst = ceil(rate)``
requests at once is allowed (a bucket of one second's requests, refilled at ``rate``). A
request at ``now`` is admitted when ``max(TAT, now) - now <= (burst - 1) * T``, and then
sets ``TAT = max(TAT, now) + T``. A refused one is told exactly when it would be admitted:
``Retry-After``.

An API process takes ``k = max(1, burst // 4)`` tokens in one trip (admitted as ``k``
requests at one instant: ``TAT += k * T``), spends the first on the request that went for
them and keeps the others for the tenant's next requests through the same process. When
fewer than ``k`` are left in the bucket it takes one: near its limit a tenant is counted
exactly. The long-run rate is exact (every request spends a token the database granted);
what grants change is when: a token granted at ``t`` and spent later counts as spent at
``t``, so after a pause a tenant can exceed its burst by the ``k - 1`` tokens each API
process may hold. Rates up to 7 per second have ``k = 1``: exact.

Concurrency: one lease row per slot. A request takes a slot its process holds free, or
inserts a row if the tenant has fewer rows than its limit (counted in the database: the
limit holds across processes exactly). When the answer ends (for a streamed answer, at
its last event or when the client goes) the slot is free in this process (``release``: no
I/O, safe on the event loop) for the tenant's next request through it; a slot left free
for ``SLOT_HOLD_S`` is deleted by a flusher thread, so it is free to the other processes
within about ``SLOT_HOLD_S``, which is the ``Retry-After`` a refused request is given. A
row is reused for ``REUSE_S`` after its insertion and counts until ``LEASE_S`` after that
(the proxy's read timeout to Serve, plus a margin): an API process that dies mid-request
gives its slots back then.

A database trip is one transaction that begins by updating the tenant's bucket row. On
PostgreSQL that row lock serialises one tenant's grants across API processes, and the
lease count that follows, a new statement, sees every committed lease (READ COMMITTED
takes a snapshot per statement). SQLite serialises all writes. Other tenants never wait on
the lock. A refused request rolls back, so it uses neither a rate token nor a slot. In a
process, one thread per tenant goes to the database; the others wait for its grant.

It is hand-written SQL on the driver's own connection (SQLAlchemy's statement layer cost
four times the CPU: ``bench/api_load.py``), and on PostgreSQL the two tables are UNLOGGED:
their commits wait for no WAL flush, and a crash empties them, which forgets only
requests that a crash ended anyway.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from tunefleet.platform.db import get_engine
from tunefleet.platform.errors import RateLimited

# The API waits at most 600 s between reads from Serve; a slot counts that long and more
# after its request's admission.
LEASE_S = 660.0
# How long a lease row is reused for the tenant's next requests after its insertion (it
# counts until LEASE_S after the last reuse could have begun).
REUSE_S = 60.0
# How long a free slot is kept for the tenant's next request through the same process
# before it is deleted, and so free to the others; what a request refused for
# concurrency is told to wait.
SLOT_HOLD_S = 1.0
CONCURRENCY_RETRY_S = SLOT_HOLD_S
# How often the flusher looks for slots to delete.
FLUSH_S = 0.1
# The highest rate the slack in ``_advance`` is exact for (the API and settings refuse
# more; 0 is no limit).
MAX_RATE = 1000.0
_NEVER = 1e18  # a tolerance no wait reaches: no rate limit

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    """A tenant's inference limits; 0 means no limit."""

    requests_per_s: float
    concurrent_requests: int

    @property
    def unlimited(self) -> bool:
        return self.requests_per_s <= 0 and self.concurrent_requests <= 0

    @property
    def grant(self) -> int:
        """The rate tokens one database trip takes (see the module's docstring)."""
        return max(1, math.ceil(self.requests_per_s) // 4)


@dataclass(frozen=True)
class Lease:
    """An admitted request's slot; give it back with ``release``."""

    id: str
    tenant_id: str
    reuse_until: float  # time.time(): later, the row is deleted when freed
    limit: int  # the concurrency it was taken under: another, and it is deleted when freed


# The statements, with ``:name`` parameters (SQLite's style; PostgreSQL's driver gets
# ``%(name)s``) and ``GREATEST`` spelled per database.
_SQL = {
    # admit and advance in one statement: PostgreSQL re-checks the WHERE on the newest row
    # after waiting for another admission's lock, so two cannot both see one TAT
    "advance": "UPDATE inference_buckets SET tat = GREATEST(tat, :now) + :interval "
    "WHERE tenant_id = :tenant AND GREATEST(tat, :now) - :now <= :tolerance RETURNING tat",
    "first": "INSERT INTO inference_buckets (tenant_id, tat) VALUES (:tenant, :first) "
    "ON CONFLICT (tenant_id) DO NOTHING RETURNING tat",
    "tat": "SELECT tat FROM inference_buckets WHERE tenant_id = :tenant",
    # typed: PostgreSQL cannot infer a parameter's type in a select list
    "take_slot": "INSERT INTO inference_leases (id, tenant_id, expires_at) "
    "SELECT CAST(:lease AS VARCHAR(64)), CAST(:tenant AS VARCHAR(64)), "
    "CAST(:expires AS DOUBLE PRECISION) WHERE CAST(:slots AS INTEGER) > "
    "(SELECT count(*) FROM inference_leases WHERE tenant_id = :tenant AND expires_at > :now) "
    "RETURNING id",
    # freed slots ({ids}: one parameter each)
    "release": "DELETE FROM inference_leases WHERE id IN ({ids})",
    # leases of an API process that died (they count no more once expired)
    "expired": "DELETE FROM inference_leases WHERE expires_at <= :now",
}


@lru_cache(maxsize=2)
def _statements(dialect: str) -> dict[str, str]:
    """``_SQL`` for ``dialect``, and ``mark``: a named parameter's placeholder."""
    if dialect == "sqlite":
        sql = {name: sql.replace("GREATEST(", "max(") for name, sql in _SQL.items()}
        return {**sql, "mark": ":{}"}
    sql = {name: re.sub(r":(\w+)", r"%(\1)s", sql) for name, sql in _SQL.items()}
    return {**sql, "mark": "%({})s"}


@dataclass
class _Tenant:
    """One tenant's allowance in this process, on one database."""

    lock: threading.Lock = field(default_factory=threading.Lock)  # the fields below
    refill: threading.Lock = field(default_factory=threading.Lock)  # one database trip
    rate: float = 0.0  # what ``tokens`` were granted under
    tokens: int = 0
    limit: int = 0  # what ``free`` was taken under
    free: list[tuple[Lease, float]] = field(default_factory=list)  # (slot, freed: monotonic)


@dataclass(frozen=True)
class _Held:
    """What a request took from its process's allowance: ``complete`` when that is all
    it needs."""

    complete: bool
    token: bool
    slot: Lease | None


class Limiter:
    """One API process's view of the limits (the module's functions use this process's);
    each instance is a process of its own to the others."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tenants: dict[tuple[str, str], _Tenant] = {}
        self._doomed: dict[str, list[str]] = {}  # lease ids to delete now, by database
        self._wake = threading.Event()
        self._flusher: threading.Thread | None = None

    def admit(
        self, database_url: str, tenant_id: str, tenant_name: str, limits: Limits
    ) -> Lease | None:
        """Admit one inference request of ``tenant_id`` under ``limits``, or raise 429
        (``RateLimited``) with how long to wait. The lease to release when the answer
        ends; None when the tenant has no concurrency limit (nothing needs releasing)."""
        if limits.unlimited:
            return None
        state = self._tenant(database_url, tenant_id)
        held = self._take(database_url, state, limits)
        if held is not None and held.complete:
            return held.slot
        with state.refill:  # the others wait for this grant, then look again
            held = self._take(database_url, state, limits, partial=True)
            assert held is not None
            if held.complete:
                return held.slot
            token, slot = held.token, held.slot
            try:
                lease = self._grant(database_url, tenant_id, tenant_name, limits, token, slot)
            except BaseException:
                self._give_back(database_url, state, limits, token, slot)
                raise
        return lease

    def release(self, database_url: str, lease: Lease) -> None:
        """Give back an admitted request's slot: free at once for the tenant's next
        request through this process, deleted after ``SLOT_HOLD_S`` unused. No I/O."""
        state = self._tenant(database_url, lease.tenant_id)
        with state.lock:
            if lease.limit == state.limit and time.time() < lease.reuse_until:
                state.free.append((lease, time.monotonic()))
                doomed = False
            else:
                doomed = True
        if doomed:
            self._doom(database_url, [lease.id])
        self._start_flusher()
        self._wake.set()

    def flush(self, database_url: str) -> None:
        """Delete every free slot this process holds now (at the API's shutdown)."""
        ids = self._idle(database_url, hold_s=-1.0)
        if ids:
            _delete_now(database_url, ids)

    # --- the allowance held here

    def _tenant(self, database_url: str, tenant_id: str) -> _Tenant:
        with self._lock:
            return self._tenants.setdefault((database_url, tenant_id), _Tenant())

    def _take(
        self, database_url: str, state: _Tenant, limits: Limits, partial: bool = False
    ) -> _Held | None:
        """What this process holds for a request under ``limits``, taken: all it needs,
        or (with ``partial``, else None) what it has for a database trip to complete."""
        want_token = limits.requests_per_s > 0
        want_slot = limits.concurrent_requests > 0
        stale: list[str] = []
        with state.lock:
            if state.rate != limits.requests_per_s:  # changed: the bucket starts afresh
                state.rate, state.tokens = limits.requests_per_s, 0
            if state.limit != limits.concurrent_requests:
                state.limit = limits.concurrent_requests
                stale = [lease.id for lease, _ in state.free]
                state.free.clear()
            now = time.time()
            while state.free and state.free[-1][0].reuse_until <= now:
                stale.append(state.free.pop()[0].id)
            has_token = not want_token or state.tokens > 0
            has_slot = not want_slot or bool(state.free)
            held = None
            if (has_token and has_slot) or partial:
                token = want_token and has_token
                slot = state.free.pop()[0] if want_slot and has_slot else None  # the newest
                state.tokens -= token
                held = _Held(has_token and has_slot, token, slot)
        if stale:
            self._doom(database_url, stale)
        return held

    def _give_back(
        self, database_url: str, state: _Tenant, limits: Limits, token: bool, slot: Lease | None
    ) -> None:
        """Return what a refused request had taken from this process's allowance."""
        with state.lock:
            state.tokens += token and state.rate == limits.requests_per_s
        if slot is not None:
            self.release(database_url, slot)

    def _grant(
        self,
        database_url: str,
        tenant_id: str,
        tenant_name: str,
        limits: Limits,
        has_token: bool,
        slot: Lease | None,
    ) -> Lease | None:
        """One database trip for what this process lacks: rate tokens (a grant, or one),
        a slot, or both; the request's lease."""
        now = time.time()
        want_tokens = limits.requests_per_s > 0 and not has_token
        want_slot = limits.concurrent_requests > 0 and slot is None
        engine = get_engine(database_url)
        sql = _statements(engine.dialect.name)
        granted = 0
        doomed = self._take_doomed(database_url)
        with _writing(engine.dialect.name):
            raw = engine.raw_connection()
            try:
                cursor = raw.cursor()
                _delete(cursor, sql, doomed)
                if want_tokens:
                    interval = 1.0 / limits.requests_per_s
                    tolerance = (math.ceil(limits.requests_per_s) - 1) * interval
                    take = (cursor, sql, tenant_id, now, interval, tolerance)
                    k = limits.grant
                    if k > 1 and _advance(*take, k) is None:
                        granted = k
                    else:
                        wait = _advance(*take, 1)
                        if wait is not None:
                            raise RateLimited(
                                f"tenant {tenant_name!r} is over its inference rate of "
                                f"{limits.requests_per_s:g} requests per second; retry in "
                                f"{wait:.2f} s, or ask an admin to raise "
                                "inference_requests_per_s",
                                retry_after_s=wait,
                            )
                        granted = 1
                elif want_slot:  # the row's lock orders the lease count
                    _advance(cursor, sql, tenant_id, now, 0.0, _NEVER, 1)
                if want_slot:
                    lease_id = f"lease-{_PROCESS}-{secrets.token_urlsafe(12)}"
                    cursor.execute(
                        sql["take_slot"],
                        {
                            "lease": lease_id,
                            "tenant": tenant_id,
                            "expires": now + REUSE_S + LEASE_S,
                            "now": now,
                            "slots": limits.concurrent_requests,
                        },
                    )
                    if cursor.fetchone() is None:
                        raise RateLimited(
                            f"tenant {tenant_name!r} has {limits.concurrent_requests} "
                            "inference requests in flight, its limit; retry when one has "
                            "answered, or ask an admin to raise inference_concurrent_requests",
                            retry_after_s=CONCURRENCY_RETRY_S,
                        )
                    slot = Lease(lease_id, tenant_id, now + REUSE_S, limits.concurrent_requests)
                raw.commit()
            except BaseException as exc:
                raw.rollback()
                if isinstance(exc, RateLimited) and doomed:  # not refused: the deletes were
                    _delete_now(database_url, doomed)
                else:
                    self._doom(database_url, doomed)
                raise
            finally:
                raw.close()  # back to the pool
        if granted > 1:
            state = self._tenant(database_url, tenant_id)
            with state.lock:
                if state.rate == limits.requests_per_s:
                    state.tokens += granted - 1
        return slot

    # --- the flusher: free slots unused for SLOT_HOLD_S, and doomed ones, are deleted

    def _doom(self, database_url: str, lease_ids: list[str]) -> None:
        with self._lock:
            self._doomed.setdefault(database_url, []).extend(lease_ids)
        self._start_flusher()
        self._wake.set()

    def _take_doomed(self, database_url: str) -> list[str]:
        with self._lock:
            return self._doomed.pop(database_url, [])

    def _idle(self, database_url: str, hold_s: float) -> list[str]:
        """Take the free slots unused for ``hold_s`` (on ``database_url``), and the
        doomed ones: the lease ids to delete."""
        ids = self._take_doomed(database_url)
        before = time.monotonic() - hold_s
        with self._lock:
            states = [s for (url, _), s in self._tenants.items() if url == database_url]
        for state in states:
            with state.lock:
                ids += [lease.id for lease, freed in state.free if freed <= before]
                state.free = [(lease, freed) for lease, freed in state.free if freed > before]
        return ids

    def _start_flusher(self) -> None:
        with self._lock:
            if self._flusher is None or not self._flusher.is_alive():
                self._flusher = threading.Thread(
                    target=self._run, name="inference-leases", daemon=True
                )
                self._flusher.start()

    def _holding(self) -> bool:
        with self._lock:
            states, doomed = list(self._tenants.values()), any(self._doomed.values())
        return doomed or any(s.free for s in states)

    def _run(self) -> None:
        while True:
            if not self._holding():
                self._wake.wait()
            self._wake.clear()
            time.sleep(FLUSH_S)
            with self._lock:
                urls = {url for url, _ in self._tenants} | set(self._doomed)
            for url in urls:
                ids = self._idle(url, SLOT_HOLD_S)
                try:
                    if ids:
                        _delete_now(url, ids)
                except Exception:  # the database away: they wait for the next pass
                    log.warning("could not free %d inference slots", len(ids), exc_info=True)
                    time.sleep(1.0)
                    self._doom(url, ids)


def _advance(
    cursor: Any,
    sql: dict[str, str],
    tenant_id: str,
    now: float,
    interval: float,
    tolerance: float,
    tokens: int,
) -> float | None:
    """Take ``tokens`` rate tokens at once (and the tenant's row lock): None, or the
    seconds to wait."""
    # A burst at one instant lands on whole intervals of the TAT: half an interval of
    # slack admits none more, and absorbs the rounding of a TAT summed interval by
    # interval (at most 1.2e-7 s per sum at today's Unix times: a burst of r sums stays
    # under 1/(2r) for any r up to MAX_RATE).
    params = {
        "tenant": tenant_id,
        "now": now,
        "interval": tokens * interval,
        "tolerance": tolerance - (tokens - 1) * interval + interval / 2,
        "first": now + tokens * interval,
    }
    cursor.execute(sql["advance"], params)
    if cursor.fetchone() is not None:
        return None
    # no row yet (the tenant's first request: made here, or by a concurrent first
    # request, whose row this one then advances), or refused
    cursor.execute(sql["first"], params)
    if cursor.fetchone() is not None:
        return None
    cursor.execute(sql["advance"], params)
    if cursor.fetchone() is not None:
        return None
    cursor.execute(sql["tat"], params)
    (tat,) = cursor.fetchone()
    return max(0.0, max(float(tat), now) - now - (tolerance - (tokens - 1) * interval))


def _delete(cursor: Any, sql: dict[str, str], lease_ids: list[str]) -> None:
    if lease_ids:
        names = [f"l{i}" for i in range(len(lease_ids))]
        marks = ", ".join(sql["mark"].format(n) for n in names)
        params: dict[str, Any] = dict(zip(names, lease_ids, strict=True))
        cursor.execute(sql["release"].format(ids=marks), params)


def _delete_now(database_url: str, lease_ids: list[str]) -> None:
    """Delete these leases, and every expired one, in a transaction of their own."""
    engine = get_engine(database_url)
    sql = _statements(engine.dialect.name)
    with _writing(engine.dialect.name):
        raw = engine.raw_connection()
        try:
            cursor = raw.cursor()
            _delete(cursor, sql, lease_ids)
            cursor.execute(sql["expired"], {"now": time.time()})
            raw.commit()
        except BaseException:
            raw.rollback()
            raise
        finally:
            raw.close()


# SQLite runs one write transaction at a time, and a writer that finds it taken sleeps in
# steps of milliseconds (its busy handler): this process's trips queue on a mutex
# instead, and only other processes' writes meet the busy handler.
_SQLITE_WRITES = threading.RLock()  # re-entered by a refusal that frees leases


def _writing(dialect: str) -> contextlib.AbstractContextManager[Any]:
    return _SQLITE_WRITES if dialect == "sqlite" else contextlib.nullcontext()


# This process's lease rows are named for it (a log line, or a look at the table, tells
# whose they are); a forked child is a process of its own, holding nothing.
_PROCESS = secrets.token_hex(4)
_limiter = Limiter()


def _forked() -> None:
    global _PROCESS, _limiter, _SQLITE_WRITES
    _PROCESS, _limiter, _SQLITE_WRITES = secrets.token_hex(4), Limiter(), threading.RLock()


os.register_at_fork(after_in_child=_forked)


def admit(database_url: str, tenant_id: str, tenant_name: str, limits: Limits) -> Lease | None:
    """``Limiter.admit`` in this process."""
    return _limiter.admit(database_url, tenant_id, tenant_name, limits)


def release(database_url: str, lease: Lease) -> None:
    """``Limiter.release`` in this process."""
    _limiter.release(database_url, lease)


def flush(database_url: str) -> None:
    """``Limiter.flush`` in this process."""
    _limiter.flush(database_url)
