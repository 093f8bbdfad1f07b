"""What a running job reports back: per-step metrics, checkpoints, the ETA.

Reported by the run's rank 0 through its channel (``workers/_run_channel.py``) and
written here by the controller (never the status: only the controller moves status).
Metric events are OpenAI-shaped ``type="metrics"`` events whose ``data`` holds ``step``,
``total_steps``, ``train_loss`` and TuneFleet's throughput figures.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sqlalchemy import case, update
from sqlalchemy.orm import Session

from tunefleet.platform.db import Checkpoint, Job, now_s
from tunefleet.platform.ids import new_id
from tunefleet.platform.status import JobStatus, add_event

log = logging.getLogger(__name__)


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
        # only on a running job: a run's last reports arrive after its job was paused or
        # cancelled, whose estimated_finish stays null (status.transition)
        values["estimated_finish"] = case(
            (Job.status == JobStatus.RUNNING.value, now_s() + int(eta_s)), else_=None
        )
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


# What a run may report through its channel, and the fields of each (the job is the
# channel's, never the run's to name).
RECORDS: dict[str, tuple[Callable[..., object], frozenset[str]]] = {
    "metrics": (
        record_metrics,
        frozenset({"step", "total_steps", "metrics", "trained_tokens", "eta_s"}),
    ),
    "checkpoint": (record_checkpoint, frozenset({"step", "path", "metrics"})),
    "message": (record_message, frozenset({"message", "level", "data"})),
}


def apply(session: Session, job: Job, run_id: str, records: list[dict[str, Any]]) -> int:
    """Write a run's records on its job, each once: the job keeps which channel's records
    are in up to which number (``Job.reported``), so records taken again after a controller
    fail-over are skipped. A record that cannot be written (a field missing or of the wrong
    type) is skipped with a warning event, alone: it must not hold up the run's others.
    Returns the number of the last record seen."""
    mark = job.reported or {}
    for record in records:
        seq, channel = int(record["seq"]), record.get("channel")
        same = mark.get("run") == run_id and mark.get("channel") == channel
        if same and seq <= int(mark["seq"]):
            continue
        mark = {"run": run_id, "channel": channel, "seq": seq}
        kind = record.get("kind")
        write, fields = RECORDS.get(str(kind), (None, frozenset()))
        try:
            if write is None:
                raise ValueError(f"unknown record kind {kind!r}")
            with session.begin_nested():
                write(session, job.id, **{k: v for k, v in record.items() if k in fields})
        except (TypeError, ValueError) as exc:
            log.error("run %s reported record %d that cannot be written: %s", run_id, seq, exc)
            add_event(
                session,
                job.id,
                f"A report of run {run_id} was skipped: {exc}"[:500],
                level="warn",
            )
    if mark != (job.reported or {}):
        job.reported = mark
    return max((int(r["seq"]) for r in records), default=0)


def wanted_stop(status: str, current_run: str | None, run_id: str) -> dict[str, Any] | None:
    """What a run must do, from its job's row: leave after a checkpoint (``paused``: the
    job was paused, or resumed before this run saw the pause, or another run is now the
    job's current one), leave now (``cancelled``), or go on (None)."""
    if status == "cancelled":
        kind = "cancelled"
    elif status in ("paused", "queued") or current_run not in (None, run_id):
        kind = "paused"
    else:
        return None
    return {"stop": kind, "status": status, "current": current_run}
