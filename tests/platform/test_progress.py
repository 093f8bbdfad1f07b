"""What a run reports through its channel, written on its job by the controller
(``progress.apply``): each record once, in order, whatever is taken again; and what the
run is told to do (``progress.wanted_stop``)."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from conftest import add_chat_file
from tunefleet.platform.artifacts import ArtifactStore
from tunefleet.platform.db import Checkpoint, Job, JobEvent, session_scope
from tunefleet.platform.jobs import JobCreateRequest, create_job
from tunefleet.platform.models import ModelRegistry
from tunefleet.platform.progress import apply, wanted_stop
from tunefleet.platform.settings import Settings
from tunefleet.platform.tenants import authenticate, create_key, create_tenant


def _job(settings: Settings) -> str:
    url = settings.resolved_database_url
    with session_scope(url) as s:
        tenant = create_tenant(s, "acme")
        principal = authenticate(s, f"Bearer {create_key(s, tenant.id)[1]}")
        add_chat_file(s, ArtifactStore(settings.resolved_artifact_root), tenant.id, "f-1", 1)
        req = JobCreateRequest.model_validate({"model": "tiny-llama", "training_file": "f-1"})
        registry = ModelRegistry(settings.resolved_model_registry)
        return create_job(s, principal, req, registry).id


def _step(seq: int) -> dict[str, object]:
    return {
        "seq": seq,
        "kind": "metrics",
        "step": seq,
        "total_steps": 4,
        "metrics": {"train_loss": 1.0 / seq},
        "trained_tokens": 100 * seq,
        "eta_s": None,
    }


def test_each_record_is_written_once_in_order(settings: Settings) -> None:
    url = settings.resolved_database_url
    job_id = _job(settings)
    first = [_step(1), _step(2)]
    checkpoint = {"seq": 3, "kind": "checkpoint", "step": 2, "path": "c/step-2", "metrics": {}}
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        assert job is not None
        assert apply(s, job, f"{job_id}-1", first) == 2
    with session_scope(url) as s:  # a fail-over: taken again before they were acknowledged
        job = s.get(Job, job_id)
        assert job is not None
        assert apply(s, job, f"{job_id}-1", [*first, checkpoint, _step(4)]) == 4
        # a record kind the platform does not know is skipped, not written
        assert apply(s, job, f"{job_id}-1", [{"seq": 5, "kind": "status", "to": "x"}]) == 5
    with session_scope(url) as s:
        steps = list(
            s.scalars(
                select(JobEvent.data["step"].as_integer())
                .where(JobEvent.job_id == job_id, JobEvent.type == "metrics")
                .order_by(JobEvent.seq)
            )
        )
        job = s.get(Job, job_id)
        assert job is not None and job.trained_tokens == 400 and job.status != "x"
        assert job.reported == {"run": f"{job_id}-1", "channel": None, "seq": 5}
        saved = list(s.scalars(select(Checkpoint.path).where(Checkpoint.job_id == job_id)))
    assert steps == [1, 2, 4]
    assert saved == ["c/step-2"]
    with session_scope(url) as s:  # the next run, or a new channel of it, numbers from 1
        job = s.get(Job, job_id)
        assert job is not None
        apply(s, job, f"{job_id}-2", [_step(1)])
        assert job.reported == {"run": f"{job_id}-2", "channel": None, "seq": 1}
        apply(s, job, f"{job_id}-2", [{**_step(1), "channel": "again"}])
        assert job.reported == {"run": f"{job_id}-2", "channel": "again", "seq": 1}
    with session_scope(url) as s:
        metrics = s.scalars(
            select(JobEvent.data["step"].as_integer()).where(
                JobEvent.job_id == job_id, JobEvent.type == "metrics"
            )
        )
        assert list(metrics) == [1, 2, 4, 1, 1]


def test_a_record_that_cannot_be_written_is_skipped_alone(settings: Settings) -> None:
    url = settings.resolved_database_url
    job_id = _job(settings)
    broken = {"seq": 2, "kind": "metrics", "step": 2}  # no total_steps, metrics, ...
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        assert job is not None
        assert apply(s, job, "r-1", [_step(1), broken, _step(3)]) == 3
    with session_scope(url) as s:
        events = list(s.scalars(select(JobEvent).where(JobEvent.job_id == job_id)))
        steps = [e.data["step"] for e in events if e.type == "metrics"]
        warned = [e.message for e in events if e.level == "warn"]
    assert steps == [1, 3]
    assert len(warned) == 1 and warned[0].startswith("A report of run r-1 was skipped")


def test_the_eta_is_set_on_a_running_job_only(settings: Settings) -> None:
    """A run's last reports arrive after its job was paused or cancelled: its
    estimated_finish, cleared by the move, stays null."""
    from tunefleet.platform.status import JobStatus as S
    from tunefleet.platform.status import transition

    url = settings.resolved_database_url
    job_id = _job(settings)
    with session_scope(url) as s:
        transition(s, job_id, S.VALIDATING_FILES, S.QUEUED, "queued")
        transition(s, job_id, S.QUEUED, S.RUNNING, "running")
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        assert job is not None
        apply(s, job, "r-1", [{**_step(1), "eta_s": 60.0}])
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        assert job is not None and job.estimated_finish is not None
        transition(s, job_id, S.RUNNING, S.PAUSED, "paused")
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        assert job is not None and job.estimated_finish is None
        apply(s, job, "r-1", [{**_step(2), "eta_s": 30.0}])
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        assert job is not None and job.estimated_finish is None and job.trained_tokens == 200


@pytest.mark.parametrize(
    ("status", "current", "wanted"),
    [
        ("running", "j-1", None),
        ("running", None, None),  # a run started by hand (tests, benchmarks)
        ("paused", "j-1", "paused"),
        ("queued", "j-1", "paused"),  # resumed before the run saw the pause
        ("running", "j-2", "paused"),  # superseded by another run
        ("cancelled", "j-1", "cancelled"),
    ],
)
def test_a_run_is_told_to_stop_from_its_jobs_row(
    status: str, current: str, wanted: str | None
) -> None:
    stop = wanted_stop(status, current, "j-1")
    assert (stop and stop["stop"]) == wanted
    if stop:
        assert stop["status"] == status and stop["current"] == current
