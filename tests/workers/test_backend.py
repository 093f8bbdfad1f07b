"""``RayBackend``'s handling of what Ray's Jobs API answers: a stub client to stage the race
between the backend's status check and its submit, and the session's real Ray cluster for
what Ray itself answers (a submit of an id it has, an id it does not know, a stop of a
finished run, and Ray away)."""

from __future__ import annotations

import logging
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tunefleet.platform.settings import Settings
from tunefleet.workers._run_channel import CLUSTER_ENV
from tunefleet.workers.backend import NOT_FOUND, SUCCEEDED, TERMINAL_RAY, RayBackend, RunInfo


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    """The backend's Jobs API calls touch no database: one settings object, not one per
    database kind."""
    return Settings(data_dir=tmp_path)


class JobsApi:
    """Answers as Ray's JobSubmissionClient does. ``won``: another submit of that id lands
    between the backend's status check and its submit, so Ray has that run and refuses
    the backend's with ``refusal``."""

    def __init__(self, refusal: str | None, won: str | None = None) -> None:
        self.refusal, self.won = refusal, won
        self.jobs: dict[str, str] = {}  # submission id -> Ray's status
        self.attempts: list[dict[str, Any]] = []  # every submit_job call, refused or not
        self.submitted: list[dict[str, Any]] = []  # the ones Ray took

    def get_job_info(self, submission_id: str) -> Any:
        if submission_id not in self.jobs:
            raise RuntimeError(
                f"Request failed with status code 404: Job {submission_id} does not exist."
            )
        return SimpleNamespace(status=SimpleNamespace(value=self.jobs[submission_id]), message="")

    def submit_job(self, **kwargs: Any) -> str:
        self.attempts.append(kwargs)
        if self.won is not None:
            self.jobs[self.won] = "RUNNING"  # the other submit, just before ours
        if self.refusal:
            raise RuntimeError(self.refusal)
        self.submitted.append(kwargs)
        self.jobs[kwargs["submission_id"]] = "PENDING"
        return str(kwargs["submission_id"])


def _backend(settings: Settings, refusal: str | None, won: str | None = None) -> RayBackend:
    backend = RayBackend(settings)
    backend._client = JobsApi(refusal, won)
    backend._gcs_address = "10.0.0.7:6379"  # what connect() reads off the cluster
    return backend


def test_a_run_is_told_the_cluster_it_was_submitted_to(settings: Settings) -> None:
    """Its driver connects there by address: Ray's Jobs API would hand it whichever
    cluster "auto" finds on the head, any of several on one machine."""
    backend = _backend(settings, None)
    backend.submit_run("ftjob-abc-1", "ftjob-abc", {"TUNEFLEET_RUN_ID": "ftjob-abc-1"})
    [submitted] = backend._client.submitted
    env = submitted["runtime_env"]["env_vars"]
    assert env[CLUSTER_ENV] == "10.0.0.7:6379" and env["TUNEFLEET_RUN_ID"] == "ftjob-abc-1"


def test_a_submit_that_ray_already_has_is_the_same_run(settings: Settings) -> None:
    """Another submit of the same id (a controller that restarted mid-dispatch) won the
    race: ours is refused, and the run Ray has is followed as ours, never submitted again."""
    sid = "ftjob-abc-1"
    refusal = (
        f"Request failed with status code 500: Job with submission_id {sid} already exists. "
        "Please use a different submission_id."
    )
    backend = _backend(settings, refusal, won=sid)
    assert backend.submit_run(sid, "ftjob-abc", {}) is None  # no error: it runs
    [attempt] = backend._client.attempts  # one submit, not retried
    assert attempt["submission_id"] == sid
    assert attempt["metadata"]["tunefleet_job_id"] == "ftjob-abc"
    assert backend._client.submitted == []  # Ray took the other submit, not ours
    assert backend.run_status(sid) == RunInfo("RUNNING")  # the run Ray has is this run
    backend.submit_run(sid, "ftjob-abc", {})  # the next pass: Ray has it, nothing submitted
    assert len(backend._client.attempts) == 1


def test_another_refusal_is_still_an_error(settings: Settings) -> None:
    backend = _backend(settings, "No available agent to submit job, please try again later.")
    with pytest.raises(RuntimeError, match="No available agent"):
        backend.submit_run("ftjob-abc-1", "ftjob-abc", {})
    # another run's id in the message is not ours
    backend = _backend(settings, "Job with submission_id ftjob-xyz-1 already exists.")
    with pytest.raises(RuntimeError, match="already exists"):
        backend.submit_run("ftjob-abc-1", "ftjob-abc", {})


# -- the session's real Ray cluster: the answers its Jobs API really gives ------------------


@pytest.fixture
def jobs_api(ray_cluster: Any) -> Any:
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(ray_cluster.dashboard)


def _on_ray(settings: Settings, ray_cluster: Any, client: Any) -> RayBackend:
    """A backend on the session's cluster, as ``connect()`` leaves one that attached to it
    (without a ``ray.init`` in this process: the Jobs API is all these calls use)."""
    backend = RayBackend(settings)
    backend._client = client
    backend._gcs_address = ray_cluster.address
    return backend


def _sid() -> str:
    return f"ftjob-{uuid.uuid4().hex[:10]}-1"  # the cluster is the session's: ids of our own


def _runs_of(client: Any, sid: str) -> list[Any]:
    return [job for job in client.list_jobs() if job.submission_id == sid]


def _wait_terminal(client: Any, sid: str) -> None:
    # bounded by a driver's start on a busy 2-core machine (a second or two when idle)
    deadline = time.monotonic() + 60
    while str(client.get_job_status(sid).value) not in TERMINAL_RAY:
        assert time.monotonic() < deadline, client.get_job_info(sid)
        time.sleep(0.2)


class Racing:
    """The real client, with another submit of the same id landing between the backend's
    status check and its submit (Ray's own refusal follows)."""

    def __init__(self, client: Any, entrypoint: str) -> None:
        self.client, self.entrypoint = client, entrypoint
        self.submits: list[str] = []  # the backend's submits
        self.raced = False

    def get_job_info(self, submission_id: str) -> Any:
        try:
            return self.client.get_job_info(submission_id)
        finally:
            if not self.raced:
                self.raced = True
                self.client.submit_job(entrypoint=self.entrypoint, submission_id=submission_id)

    def submit_job(self, **kwargs: Any) -> str:
        self.submits.append(kwargs["submission_id"])
        return str(self.client.submit_job(**kwargs))


@pytest.mark.slow
def test_real_ray_refusing_a_submit_it_already_has_is_the_same_run(
    settings: Settings, ray_cluster: Any, jobs_api: Any
) -> None:
    """Ray's own words for a submission id it has (not a stub's) are recognised: the
    backend's submit returns, Ray keeps the one run the other submit started, and the
    backend follows it."""
    sid, other = _sid(), "echo the other submit"
    racing = Racing(jobs_api, other)
    backend = _on_ray(settings, ray_cluster, racing)
    backend.submit_run(sid, "ftjob-raced", {})
    assert racing.raced and racing.submits == [sid]  # checked, raced, submitted once: refused
    [run] = _runs_of(jobs_api, sid)
    assert run.entrypoint == other  # the run Ray has is the other submit's
    assert backend.run_status(sid).status in {"PENDING", "RUNNING", SUCCEEDED}


@pytest.mark.slow
def test_real_ray_answers_for_unknown_finished_and_existing_runs(
    settings: Settings, ray_cluster: Any, jobs_api: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """An id Ray does not know is NOT_FOUND (its 404), its logs empty, and a stop of it is
    said in the log, not raised; a stop of a finished run changes nothing and raises
    nothing; a submit of an id Ray has submits nothing."""
    backend = _on_ray(settings, ray_cluster, jobs_api)
    unknown = _sid()
    assert backend.run_status(unknown) == RunInfo(NOT_FOUND)
    assert backend.run_logs_tail(unknown) == ""
    with caplog.at_level(logging.WARNING, logger="tunefleet.workers.backend"):
        backend.stop_run(unknown)
    [said] = [r.getMessage() for r in caplog.records if unknown in r.getMessage()]
    assert said.startswith(f"stopping {unknown}:") and "does not exist" in said

    finished = _sid()
    jobs_api.submit_job(entrypoint="echo done", submission_id=finished)
    _wait_terminal(jobs_api, finished)
    assert backend.run_status(finished).status == SUCCEEDED
    backend.stop_run(finished)  # nothing left to stop
    assert backend.run_status(finished).status == SUCCEEDED
    assert "done" in backend.run_logs_tail(finished).splitlines()  # after Ray's own lines
    backend.submit_run(finished, "ftjob-again", {})  # Ray has it: a no-op
    [run] = _runs_of(jobs_api, finished)
    assert run.entrypoint == "echo done" and run.status.value == SUCCEEDED


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A port of 127.0.0.1 that refuses connections: bound by us (so no one else takes it)
    and never listening."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield int(sock.getsockname()[1])


@pytest.mark.slow
def test_ray_away_is_an_error_never_a_missing_run(
    settings: Settings, ray_cluster: Any, jobs_api: Any, closed_port: int
) -> None:
    """Ray's Jobs API unreachable (connection refused) raises from a status query and a
    submit: a run is never taken as gone (the controller would fail or resubmit it), and a
    submit is never taken as done (the controller retries it after a backoff)."""
    import requests
    from ray.job_submission import JobSubmissionClient

    with pytest.raises(ConnectionError, match=f"127.0.0.1:{closed_port}"):
        JobSubmissionClient(f"http://127.0.0.1:{closed_port}")  # connect() on Ray away

    jobs_api._address = f"http://127.0.0.1:{closed_port}"  # Ray went away after connect()
    backend = _on_ray(settings, ray_cluster, jobs_api)
    sid = _sid()
    with pytest.raises(requests.exceptions.ConnectionError):
        backend.run_status(sid)
    with pytest.raises(requests.exceptions.ConnectionError):
        backend.submit_run(sid, "ftjob-away", {})
