"""The job state machine: every pair of states, compare-and-set, and the event row."""

from __future__ import annotations

import itertools

import pytest
from sqlalchemy import select

from tunefleet.platform.db import Job, JobEvent, session_scope
from tunefleet.platform.errors import Conflict
from tunefleet.platform.status import TERMINAL, TRANSITIONS, JobStatus, can_transition, transition
from tunefleet.platform.tenants import create_tenant

S = JobStatus


def _job(url: str, status: JobStatus) -> str:
    with session_scope(url) as s:
        tenant = create_tenant(s, f"t{abs(hash(status.value)) % 10**8}-{id(s) % 1000}")
        job = Job(
            id=f"ftjob-{status.value}-{id(s)}",
            tenant_id=tenant.id,
            status=status.value,
            model="m",
            training_file="f",
            spec={},
            request={},
            metadata_={},
            result_files=[],
            priority=0,
            attempt=0,
            estimated_finish=ETA,
        )
        s.add(job)
        return job.id


ETA = 1_900_000_000  # an estimated_finish a running job's metrics set


def test_terminal_states_have_no_way_out() -> None:
    for state in TERMINAL:
        assert TRANSITIONS[state] == frozenset()
    assert set(TRANSITIONS) == set(JobStatus)


@pytest.mark.parametrize("src,dst", list(itertools.product(JobStatus, JobStatus)))
def test_every_pair_of_states(src: JobStatus, dst: JobStatus, migrated_url: str) -> None:
    job_id = _job(migrated_url, src)
    with session_scope(migrated_url) as s:
        if can_transition(src, dst):
            transition(s, job_id, src, dst, f"{src} -> {dst}")
        else:
            with pytest.raises(ValueError, match=f"{src.value} -> {dst.value}"):
                transition(s, job_id, src, dst, "forbidden")
    with session_scope(migrated_url) as s:
        job = s.get(Job, job_id)
        assert job is not None
        events = list(s.scalars(select(JobEvent).where(JobEvent.job_id == job_id)))
        if can_transition(src, dst):
            assert job.status == dst.value
            assert [e.message for e in events] == [f"{src} -> {dst}"]
            assert (job.finished_at is not None) == (dst in TERMINAL)
            # OpenAI: null unless running (paused, cancelled, failed, queued again)
            assert job.estimated_finish == (ETA if dst is S.RUNNING else None)
        else:
            assert job.status == src.value
            assert events == []
            assert job.estimated_finish == ETA


def test_compare_and_set_loses_to_the_first_writer(migrated_url: str) -> None:
    job_id = _job(migrated_url, S.QUEUED)
    with session_scope(migrated_url) as s:
        transition(s, job_id, S.QUEUED, S.CANCELLED, "cancelled by user")
    with session_scope(migrated_url) as s, pytest.raises(Conflict, match="is cancelled"):
        transition(s, job_id, S.QUEUED, S.RUNNING, "dispatch")
    with session_scope(migrated_url) as s:
        assert s.get(Job, job_id).status == "cancelled"  # type: ignore[union-attr]
        n = len(list(s.scalars(select(JobEvent).where(JobEvent.job_id == job_id))))
        assert n == 1


def test_the_table_says_where_a_cancel_and_a_pause_may_come_from() -> None:
    """The routes hard-coded these lists beside the table; now they ask it."""
    from tunefleet.platform.status import ACTIVE, sources

    assert sources(S.CANCELLED) == [S.VALIDATING_FILES, S.QUEUED, S.RUNNING, S.PAUSED]
    assert sources(S.PAUSED) == [S.QUEUED, S.RUNNING]
    assert set(ACTIVE) == {S.VALIDATING_FILES, S.QUEUED, S.RUNNING, S.PAUSED}


def test_an_event_has_one_of_openais_levels(migrated_url: str) -> None:
    from tunefleet.platform.status import add_event

    job_id = _job(migrated_url, S.RUNNING)
    with session_scope(migrated_url) as s:
        add_event(s, job_id, "said warning", level="warning")  # earlier code's spelling
        add_event(s, job_id, "said warn", level="warn")
        with pytest.raises(ValueError, match="'loud' is not one of info, warn, error"):
            add_event(s, job_id, "said loud", level="loud")
    with session_scope(migrated_url) as s:
        levels = s.scalars(select(JobEvent.level).where(JobEvent.job_id == job_id))
        assert list(levels) == ["warn", "warn"]
