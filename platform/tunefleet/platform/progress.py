"""What a running job reports back: per-step metrics, checkpoints, the ETA.

Written by the training driver's rank 0 (never the status: only the controller moves
status). Metric events are OpenAI-shaped ``type="metrics"`` events whose ``data`` holds
``step``, ``total_steps``, ``train_loss`` and TuneFleet's throughput figures.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import update
from sqlalchemy.orm import Session

from tunefleet.platform.db.models import Checkpoint, Job, now_s
from tunefleet.platform.ids import new_id
from tunefleet.platform.status import add_event


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
