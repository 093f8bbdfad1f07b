"""Capacity the cluster does not have yet: what the controller asks Ray's autoscaler for.

The scheduling policy (``platform.scheduler.plan``) says which queued jobs wait for nodes
the autoscaler can still add (a ``Wait`` with a ``Grow``). Here the controller:

- asks for them with one ``request_resources`` call holding every such job's gang (one
  bundle per worker) and every running job's workers. Ray's autoscaler scales until all
  of those bundles fit the cluster's *total* capacity at once, so the running jobs' must
  be in the request too, or their nodes would count as room for the waiting ones;
- asks again when that set of bundles changes, and at least every ``REASSERT_S`` (the
  request is one per cluster, the last one sent: anything else on the cluster that sends
  one, such as Ray's "AutoscalingCoordinator" for Ray Data, replaces it; TuneFleet's own
  runs send none, see ``train/driver.py``). A job that stops waiting because it
  started stays in the request as a running one (from the pass that dispatches it: its
  node is idle until Ray places the run, and the autoscaler would take an idle node no
  request holds). The request is withdrawn (an empty one) once nothing waits or runs, and
  a running job's bundles leave it when it ends, so the groups scale back down;
- remembers since when each job has waited for nodes (its wait event carries the time,
  so a controller that takes over continues the count) and fails a job that has waited
  longer than ``Settings.capacity_wait_s`` with ``capacity_timeout``.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime
from typing import Any, Protocol

from sqlalchemy import select
from sqlalchemy.orm import Session

from tunefleet.platform.db import JobEvent
from tunefleet.platform.scheduler import Grow

log = logging.getLogger(__name__)

# The key of a wait event's data that holds when the job's nodes were first asked for.
REQUESTED_AT = "capacity_requested_at"
# The request is sent again this often when unchanged, repairing one that something else
# on the cluster replaced.
REASSERT_S = 30.0


class _Requests(Protocol):
    def request_capacity(self, bundles: list[dict[str, float]]) -> None: ...


class CapacityRequests:
    """The controller's outstanding request to Ray's autoscaler, and how long each job
    has waited for it."""

    def __init__(self, backend: _Requests, wait_limit_s: float):
        self.backend = backend
        self.wait_limit_s = wait_limit_s
        self._since: dict[str, float] = {}  # job id -> when its nodes were first asked for
        self._asked: list[dict[str, float]] | None = None  # None: not asked by this process
        self._asked_at = 0.0  # time.monotonic() of the last request sent

    def since(self, s: Session, job_id: str, now: float) -> float:
        """When ``job_id``'s nodes were first asked for: remembered, else read from its
        newest event (a controller taking over mid-wait), else now."""
        if job_id not in self._since:
            data = s.scalar(
                select(JobEvent.data)
                .where(JobEvent.job_id == job_id)
                .order_by(JobEvent.seq.desc())
                .limit(1)
            )
            earlier = (data or {}).get(REQUESTED_AT)
            self._since[job_id] = float(earlier) if isinstance(earlier, int | float) else now
        return self._since[job_id]

    def reason(self, grow: Grow, since: float) -> tuple[str, dict[str, Any]]:
        """The queue reason of a job waiting for ``grow`` (a stable text: it is written
        once, not every pass) and its event's data."""
        at = datetime.fromtimestamp(since, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        return (
            f"waiting for the autoscaler to add {grow.describe()} (requested at {at})",
            {
                REQUESTED_AT: since,
                "capacity_request": {"nodes": dict(grow.nodes), "bundles": list(grow.bundles)},
            },
        )

    def overdue(self, job_id: str, now: float) -> str | None:
        """Why ``job_id`` has waited too long for nodes, or None."""
        waited = now - self._since.get(job_id, now)
        if waited <= self.wait_limit_s:
            return None
        return (
            f"the job waited {waited:.0f} s for the autoscaler to add the nodes it needs, "
            f"longer than the {self.wait_limit_s:.0f} s allowed (TUNEFLEET_CAPACITY_WAIT_S); "
            "check that the node group can scale up (its maxReplicas, the cloud's quota and "
            "node pool), then resume or create the job again"
        )

    def ask(self, waiting: dict[str, Grow], running: list[dict[str, float]]) -> None:
        """Ask for the nodes ``waiting`` jobs need beside the ``running`` workers' bundles
        (an empty request, the request withdrawn, when there are neither); jobs no longer
        waiting are forgotten."""
        self._since = {k: v for k, v in self._since.items() if k in waiting}
        bundles = [b for job_id in sorted(waiting) for b in waiting[job_id].bundles] + running
        started = time.monotonic()
        changed = bundles != self._asked
        if not changed and started - self._asked_at < REASSERT_S:
            return
        self.backend.request_capacity(bundles)
        self._asked, self._asked_at = bundles, started
        if changed:
            log.info(
                "asked Ray's autoscaler for %d bundle(s) for %d waiting job(s) in %.3f s",
                len(bundles), len(waiting), time.monotonic() - started,
            )  # fmt: skip
