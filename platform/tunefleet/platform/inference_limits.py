"""Per-tenant inference limits: requests per second and requests in flight. The state is
in the database, so the limits hold across API processes and replicas.

Rate: GCRA, the generic cell rate algorithm (ATM's, and redis-cell's). One row per tenant
holds the theoretical arrival time (TAT) of its next request. With ``rate`` requests per
second, the emission interval is ``T = 1 / rate``, and a burst of ``ceil(rate)`` requests
at once is allowed (a bucket of one second's requests, refilled at ``rate``). A request
at ``now`` is admitted when ``max(TAT, now) - now <= (burst - 1) * T``, and then sets
``TAT = max(TAT, now) + T``. A refused one is told exactly when it would be admitted:
``Retry-After``.

Concurrency: one lease row per request in flight. When its answer ends (for a streamed
answer, at its last event or when the client goes) the lease is queued for deletion in
this process (``release``: no I/O on the event loop, no thread hop): the process's next
admission deletes the queued leases in its own transaction, before it counts, and a
flusher thread deletes them within ``FLUSH_S`` when no admission comes. So a tenant's
finished requests free their slots at once for its next request through the same API
process, and within ``FLUSH_S`` for the others. A lease expires after ``LEASE_S`` (the
proxy's read timeout to Serve, plus a margin), so an API process that dies mid-request
gives its slots back then.

Both checks are one transaction that begins by updating the tenant's bucket row. On
PostgreSQL that row lock serialises one tenant's admissions across API processes, and the
lease count that follows, a new statement, sees every committed lease (READ COMMITTED
takes a snapshot per statement). SQLite serialises all writes. Other tenants never wait on
the lock. A refused request rolls back, so it uses neither a rate token nor a slot.

Every inference request pays for this, so it is hand-written SQL on the driver's own
connection (SQLAlchemy's statement layer cost four times the CPU: ``bench/api_load.py``),
and on PostgreSQL the two tables are UNLOGGED: their commits wait for no WAL flush, and a
crash empties them, which forgets only requests that a crash ended anyway.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import secrets
import threading
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from tunefleet.platform.db import get_engine
from tunefleet.platform.errors import RateLimited

# The API waits at most 600 s between reads from Serve; a lease outlives that.
LEASE_S = 660.0
# What a request refused for concurrency is told to wait: a slot frees when any of the
# tenant's requests ends, which the API cannot foresee.
CONCURRENCY_RETRY_S = 1.0
# The highest rate the slack in ``_admit`` is exact for (the API and settings refuse
# more; 0 is no limit).
MAX_RATE = 1000.0
_NEVER = 1e18  # a tolerance no wait reaches: no rate limit
# How soon a finished request's slot is free for the other API processes, at most.
FLUSH_S = 0.1

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    """A tenant's inference limits; 0 means no limit."""

    requests_per_s: float
    concurrent_requests: int

    @property
    def unlimited(self) -> bool:
        return self.requests_per_s <= 0 and self.concurrent_requests <= 0


@dataclass(frozen=True)
class Lease:
    """An admitted request's slot; give it back with ``release``."""

    id: str
    tenant_id: str


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
    # finished requests' leases ({ids}: one parameter each)
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


def admit(database_url: str, tenant_id: str, tenant_name: str, limits: Limits) -> Lease | None:
    """Admit one inference request of ``tenant_id`` under ``limits``, or raise 429
    (``RateLimited``) with how long to wait. The lease to release when the answer ends;
    None when the tenant has no concurrency limit (then nothing needs releasing)."""
    if limits.unlimited:
        return None
    now = time.time()
    if limits.requests_per_s > 0:
        interval = 1.0 / limits.requests_per_s
        tolerance = (math.ceil(limits.requests_per_s) - 1) * interval
    else:  # the row is still updated: its lock orders the lease count
        interval, tolerance = 0.0, _NEVER
    engine = get_engine(database_url)
    sql = _statements(engine.dialect.name)
    lease = Lease("lease-" + secrets.token_urlsafe(18), tenant_id)
    finished = _finished.take(database_url)
    with _writing(engine.dialect.name):
        raw = engine.raw_connection()
        try:
            cursor = raw.cursor()
            _delete(cursor, sql, finished)
            wait = _advance(cursor, sql, tenant_id, now, interval, tolerance)
            if wait is not None:
                raise RateLimited(
                    f"tenant {tenant_name!r} is over its inference rate of "
                    f"{limits.requests_per_s:g} requests per second; retry in {wait:.2f} s, "
                    "or ask an admin to raise inference_requests_per_s",
                    retry_after_s=wait,
                )
            if limits.concurrent_requests > 0:
                cursor.execute(
                    sql["take_slot"],
                    {
                        "lease": lease.id,
                        "tenant": tenant_id,
                        "expires": now + LEASE_S,
                        "now": now,
                        "slots": limits.concurrent_requests,
                    },
                )
                if cursor.fetchone() is None:
                    raise RateLimited(
                        f"tenant {tenant_name!r} has {limits.concurrent_requests} inference "
                        "requests in flight, its limit; retry when one has answered, or ask "
                        "an admin to raise inference_concurrent_requests",
                        retry_after_s=CONCURRENCY_RETRY_S,
                    )
            raw.commit()
        except BaseException as exc:
            raw.rollback()
            if isinstance(exc, RateLimited) and finished:  # not refused: the deletes were
                _delete_now(database_url, finished)
            else:
                _finished.put(database_url, finished)
            raise
        finally:
            raw.close()  # back to the pool
    return lease if limits.concurrent_requests > 0 else None


def _advance(
    cursor: Any, sql: dict[str, str], tenant_id: str, now: float, interval: float, tolerance: float
) -> float | None:
    """Take a rate token (and the tenant's row lock): None, or the seconds to wait."""
    # A burst at one instant lands on whole intervals of the TAT: half an interval of
    # slack admits none more, and absorbs the rounding of a TAT summed interval by
    # interval (at most 1.2e-7 s per sum at today's Unix times: a burst of r sums stays
    # under 1/(2r) for any r up to MAX_RATE).
    params = {
        "tenant": tenant_id,
        "now": now,
        "interval": interval,
        "tolerance": tolerance + interval / 2,
        "first": now + interval,
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
    return max(0.0, max(float(tat), now) - now - tolerance)


def release(database_url: str, lease: Lease) -> None:
    """Give back an admitted request's slot: queued, deleted by this process's next
    admission or by the flusher within ``FLUSH_S``. No I/O: safe on the event loop."""
    _finished.put(database_url, [lease.id])


def flush(database_url: str) -> None:
    """Delete the finished leases queued in this process now (at the API's shutdown)."""
    finished = _finished.take(database_url)
    if finished:
        _delete_now(database_url, finished)


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
# steps of milliseconds (its busy handler): this process's admissions queue on a mutex
# instead, and only other processes' writes meet the busy handler.
_SQLITE_WRITES = threading.RLock()  # re-entered by a refusal that frees leases


def _writing(dialect: str) -> contextlib.AbstractContextManager[Any]:
    return _SQLITE_WRITES if dialect == "sqlite" else contextlib.nullcontext()


class _Finished:
    """The finished requests' leases of this process, by database, until deleted; a
    daemon thread deletes them within ``FLUSH_S`` when no admission has."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids: dict[str, list[str]] = {}
        self._wake = threading.Event()
        self._flusher: threading.Thread | None = None

    def put(self, database_url: str, lease_ids: list[str]) -> None:
        if not lease_ids:
            return
        with self._lock:
            self._ids.setdefault(database_url, []).extend(lease_ids)
            if self._flusher is None or not self._flusher.is_alive():
                self._flusher = threading.Thread(
                    target=self._run, name="inference-leases", daemon=True
                )
                self._flusher.start()
        self._wake.set()

    def take(self, database_url: str) -> list[str]:
        with self._lock:
            return self._ids.pop(database_url, [])

    def _run(self) -> None:
        while True:
            self._wake.wait()
            time.sleep(FLUSH_S)  # an admission may take them first, in its transaction
            self._wake.clear()
            with self._lock:
                urls = list(self._ids)
            for url in urls:
                finished = self.take(url)
                try:
                    if finished:
                        _delete_now(url, finished)
                except Exception:  # the database away: they wait for the next pass
                    log.warning("could not free %d inference leases", len(finished), exc_info=True)
                    time.sleep(1.0)
                    self.put(url, finished)


_finished = _Finished()
