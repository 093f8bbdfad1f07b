"""A run's writes to its job through a database outage (``Reporter``), on PostgreSQL: the
run goes on, and every step is in the job's events, in order, once the database is back."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.exc import OperationalError

from conftest import add_chat_file
from pg import database_away
from tunefleet.platform.artifacts import ArtifactStore
from tunefleet.platform.db import Job, JobEvent, session_scope
from tunefleet.platform.jobs import JobCreateRequest, create_job
from tunefleet.platform.models import ModelRegistry
from tunefleet.platform.progress import Reporter, record_metrics
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


def test_writes_wait_through_an_outage_and_go_in_in_order(
    settings: Settings, db_kind: str, request: Any
) -> None:
    if db_kind != "postgres":
        pytest.skip("an outage is staged on PostgreSQL (connections cut and refused)")
    url = settings.resolved_database_url
    job_id = _job(settings)
    reporter = Reporter(url)

    def step(n: int) -> Any:
        return partial(
            record_metrics,
            job_id=job_id,
            step=n,
            total_steps=4,
            metrics={"train_loss": 1.0 / n},
            trained_tokens=100 * n,
            eta_s=None,
        )

    reporter.write(step(1))
    with database_away(request.getfixturevalue("pg_server"), url):
        reporter.write(step(2))  # no error: the run goes on
        reporter.write(step(3))
        assert len(reporter.pending) == 2
        status = reporter.read(lambda s: s.scalar(select(Job.status).where(Job.id == job_id)), "?")
        assert status == "?"  # nobody can have asked the run to stop
        with pytest.raises(OperationalError):
            reporter.flush(wait_s=0.5)  # the end of a run waits, then fails the run
        assert len(reporter.pending) == 2  # and loses nothing
    reporter.write(step(4))
    assert reporter.pending == []
    with session_scope(url) as s:
        steps = list(
            s.scalars(
                select(JobEvent.data["step"].as_integer())
                .where(JobEvent.job_id == job_id, JobEvent.type == "metrics")
                .order_by(JobEvent.seq)
            )
        )
        job = s.get(Job, job_id)
        assert job is not None and job.trained_tokens == 400
    assert steps == [1, 2, 3, 4]
