"""Leader election for controllers: one lease row that a single holder renews.

Protocol. Every controller calls ``Lease.acquire()`` once per pass. It is a compare-and-set
on the ``controller_leases`` row: take it if this holder already holds it or the current
lease has expired, else leave it alone. The first acquire on an empty table inserts the
row; of two racing inserts the primary key lets one through. Only the holder of the
unexpired lease dispatches. ``term`` grows by one whenever the holder changes, so it is a
fencing token: a deposed leader's term is lower than its successor's. ``release()``
expires the lease at once so a standby takes over on its next pass, not after the TTL.

Clock assumption. Expiry is compared with each controller's own clock, so controllers'
clocks must agree to well within the TTL. Renew every pass and make the TTL several
passes long, so a leader that misses one pass (a slow query, a GC pause) keeps the lease.

Fencing. A leader can stall past its TTL (a long pass, a GC pause, a frozen VM) while a
standby takes over, then wake and go on writing. So every controller write transaction
ends with ``fence()``: a no-op update of the lease row that matches only this holder at the
term it won. It fails (``LeaseLost``, the transaction rolls back) once a successor holds
the row, and otherwise locks it until commit (a row lock on PostgreSQL, the write lock on
SQLite), so a takeover is ordered after the writes it would fence. Every job status change
is also a compare-and-set (``status.transition``): two controllers cannot both move the
same job even without the fence.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from collections.abc import Callable

from sqlalchemy import case, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from tunefleet.platform.db import ControllerLease, get_engine

_MAX_NAME = 64  # controller_leases.name is String(64)
_MAX_HOLDER = 128  # controller_leases.holder is String(128)


def _default_holder() -> str:
    # The random suffix keeps two leases in one process (tests, a restarted loop) apart.
    suffix = f":{os.getpid()}:{secrets.token_hex(4)}"
    return socket.gethostname()[: _MAX_HOLDER - len(suffix)] + suffix


class LeaseLost(RuntimeError):
    """This controller no longer holds the lease at the term it won: a successor leads."""


class Lease:
    """One controller's handle on the lease row called ``name``.

    After each ``acquire()`` or ``release()``, ``is_leader`` says whether this holder holds
    the unexpired lease and ``term`` is the term it holds (the fencing token), or None.
    Database errors propagate; the lease then counts as not held.
    """

    def __init__(
        self,
        db_url: str,
        *,
        name: str = "controller",
        holder: str | None = None,
        ttl_s: float = 10.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        holder = _default_holder() if holder is None else holder
        if not 0 < len(name) <= _MAX_NAME:
            raise ValueError(f"lease name {name!r} must be 1 to {_MAX_NAME} characters")
        if not 0 < len(holder) <= _MAX_HOLDER:
            raise ValueError(
                f"lease holder {holder!r} must be 1 to {_MAX_HOLDER} characters; "
                "pass a shorter holder or leave it unset for the default"
            )
        if not ttl_s > 0:
            raise ValueError(f"lease ttl_s={ttl_s!r} must be positive; use several passes")
        self.db_url = db_url
        self.name = name
        self.holder = holder
        self.ttl_s = ttl_s
        self._clock = clock
        self.term: int | None = None
        self.is_leader = False

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    def acquire(self) -> bool:
        """Acquire or renew the lease; True when this holder holds it after the call."""
        self.term, self.is_leader = None, False
        now = self._now_ms()
        expires = now + int(self.ttl_s * 1000)
        lease = ControllerLease
        with get_engine(self.db_url).begin() as conn:
            taken = conn.execute(
                update(lease)
                .where(
                    lease.name == self.name,
                    (lease.holder == self.holder) | (lease.expires_ms < now),
                )
                .values(
                    holder=self.holder,
                    expires_ms=expires,
                    # Renewing keeps the term; taking over from someone else bumps it.
                    term=case((lease.holder == self.holder, lease.term), else_=lease.term + 1),
                )
            )
            if taken.rowcount == 1:
                # Same transaction: the row is ours until commit, so this is our term.
                term = conn.scalar(select(lease.term).where(lease.name == self.name))
            else:
                exists = conn.scalar(select(lease.name).where(lease.name == self.name))
                if exists is not None:
                    return False  # someone else holds an unexpired lease
                term = None
        if term is None:
            try:
                with get_engine(self.db_url).begin() as conn:
                    conn.execute(
                        insert(lease).values(
                            name=self.name, holder=self.holder, term=1, expires_ms=expires
                        )
                    )
            except IntegrityError:
                return False  # another controller inserted the row first
            term = 1
        self.term, self.is_leader = term, True
        return True

    def fence(self, session: Session) -> None:
        """Last statement of a controller's write transaction: raise ``LeaseLost`` (and
        count as not leading) unless this holder still holds the lease at ``term``; when it
        does, the lease row stays locked until the transaction ends (see the module's
        notes on fencing)."""
        lease = ControllerLease
        held = session.execute(
            update(lease)
            .where(
                lease.name == self.name,
                lease.holder == self.holder,
                lease.term == self.term,
            )
            .values(term=lease.term)
        )
        if held.rowcount != 1:  # type: ignore[attr-defined]
            lost = self.term
            self.term, self.is_leader = None, False
            raise LeaseLost(
                f"lease {self.name!r} of term {lost} was taken over; this controller's "
                "writes of the pass are rolled back and it stands by"
            )

    def release(self) -> None:
        """Give up the lease if this holder holds it, so a standby takes over at once."""
        lease = ControllerLease
        with get_engine(self.db_url).begin() as conn:
            conn.execute(
                update(lease)
                .where(lease.name == self.name, lease.holder == self.holder)
                .values(expires_ms=0)
            )
        self.term, self.is_leader = None, False
