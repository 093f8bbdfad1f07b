"""``RayBackend``'s handling of what Ray's Jobs API answers (a stub client; the real one is
exercised by tests/e2e)."""

from __future__ import annotations

from typing import Any

import pytest

from tunefleet.platform.settings import Settings
from tunefleet.workers._run_channel import CLUSTER_ENV
from tunefleet.workers.backend import RayBackend


class JobsApi:
    """Answers as Ray's JobSubmissionClient does when another submit of the same id won
    the race between our status check and our submit."""

    def __init__(self, refusal: str | None) -> None:
        self.refusal = refusal
        self.submitted: list[dict[str, Any]] = []

    def get_job_info(self, submission_id: str) -> Any:
        raise RuntimeError(
            f"Request failed with status code 404: Job {submission_id} does not exist."
        )

    def submit_job(self, **kwargs: Any) -> str:
        if self.refusal:
            raise RuntimeError(self.refusal)
        self.submitted.append(kwargs)
        return str(kwargs["submission_id"])


def _backend(settings: Settings, refusal: str | None) -> RayBackend:
    backend = RayBackend(settings)
    backend._client = JobsApi(refusal)
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
    sid = "ftjob-abc-1"
    refusal = (
        f"Request failed with status code 500: Job with submission_id {sid} already exists. "
        "Please use a different submission_id."
    )
    _backend(settings, refusal).submit_run(sid, "ftjob-abc", {})  # no error: it runs


def test_another_refusal_is_still_an_error(settings: Settings) -> None:
    backend = _backend(settings, "No available agent to submit job, please try again later.")
    with pytest.raises(RuntimeError, match="No available agent"):
        backend.submit_run("ftjob-abc-1", "ftjob-abc", {})
    # another run's id in the message is not ours
    backend = _backend(settings, "Job with submission_id ftjob-xyz-1 already exists.")
    with pytest.raises(RuntimeError, match="already exists"):
        backend.submit_run("ftjob-abc-1", "ftjob-abc", {})
