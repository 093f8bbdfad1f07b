"""What a running job reports back: per-step metrics, checkpoints, the ETA.

Written by the training driver's rank 0 (never the status: only the controller moves
status). Metric events are OpenAI-shaped ``type="metrics"`` events whose ``data`` holds
``step``, ``total_steps``, ``train_loss`` and TuneFleet's throughput figures.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy import update
from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import Session

from tunefleet.platform.db.models import Checkpoint, Job, now_s
from tunefleet.platform.db.session import session_scope
from tunefleet.platform.ids import new_id
from tunefleet.platform.status import add_event

log = logging.getLogger(__name__)
T = TypeVar("T")


def record_metrics(
    session: Session,
    job_id: str,
    *,
    step: int,
    total_steps: int,
    metrics: dict[str, Any],
    trained_tokens: int,
    eta_s: float | None,
) -> None:
    data = {"step": step, "total_steps": total_steps, **metrics}
    loss = metrics.get("train_loss")
    loss_text = f", training loss={loss:.4f}" if isinstance(loss, float) else ""
    add_event(session, job_id, f"Step {step}/{total_steps}{loss_text}", type="metrics", data=data)
    values: dict[str, Any] = {"trained_tokens": trained_tokens, "updated_at": now_s()}
    if eta_s is not None:
        values["estimated_finish"] = now_s() + int(eta_s)
    session.execute(update(Job).where(Job.id == job_id).values(**values))


def record_checkpoint(
    session: Session, job_id: str, *, step: int, path: str, metrics: dict[str, Any]
) -> Checkpoint:
    ckpt = Checkpoint(
        id=new_id("checkpoint"),
        job_id=job_id,
        step=step,
        path=path,
        metrics=metrics,
        created_at=now_s(),
    )
    session.add(ckpt)
    add_event(session, job_id, f"Checkpoint saved at step {step}", data={"step": step})
    return ckpt


def record_message(
    session: Session,
    job_id: str,
    message: str,
    level: str = "info",
    data: dict[str, Any] | None = None,
) -> None:
    add_event(session, job_id, message, level=level, data=data)


# How long a run's last writes wait for a database that is away before the run fails
# (and is retried from its checkpoint by the controller).
FINAL_WRITE_WAIT_S = 600.0


class Reporter:
    """A run's writes to its job (events, checkpoints, progress), applied in order. While
    the database is unreachable (a restart, a fail-over, a short outage) they wait in
    memory and go in, in one transaction, with the next write that reaches it: the run
    neither fails nor loses a step. ``flush(wait_s)`` at the end waits for the database.
    Reads (``read``) answer their default while it is away."""

    def __init__(self, db_url: str) -> None:
        self.db_url = db_url
        self.pending: list[Callable[[Session], object]] = []
        self.away_since: float | None = None

    def write(self, change: Callable[[Session], object]) -> None:
        self.pending.append(change)
        self.flush()

    def flush(self, wait_s: float = 0.0) -> None:
        """Apply what waits; with ``wait_s``, retry for that long, then raise."""
        deadline = time.monotonic() + wait_s
        while self.pending:
            try:
                with session_scope(self.db_url) as s:
                    for change in self.pending:
                        change(s)
            except (OperationalError, PoolTimeout) as exc:
                if self.away_since is None:
                    self.away_since = time.monotonic()
                    log.warning("database away; %d write(s) wait: %s", len(self.pending), exc)
                if time.monotonic() >= deadline:
                    if wait_s:
                        raise
                    return
                time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))
                continue
            if self.away_since is not None:
                log.warning(
                    "database back after %.0f s; %d write(s) applied",
                    time.monotonic() - self.away_since,
                    len(self.pending),
                )
                self.away_since = None
            self.pending.clear()

    def read(self, query: Callable[[Session], T], default: T) -> T:
        if self.pending:
            self.flush()
        try:
            with session_scope(self.db_url) as s:
                return query(s)
        except (OperationalError, PoolTimeout):
            return default
