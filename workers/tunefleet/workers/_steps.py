"""What the controller's steps (``controller.py``) share: the lease-fenced session they
write through (``Writing``, ``Controller._writing``), skipping a job that someone else
moved first (``moved_on``), the fault-injection tests' failpoints (``failpoint``), and the
writes more than one step makes on a job (``fail_unreadable``, ``retry_later``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Callable, Iterator

from pydantic import ValidationError
from sqlalchemy.orm import Session

from tunefleet.platform.db import now_s
from tunefleet.platform.errors import Conflict
from tunefleet.platform.scheduler import MAX_RUN_FAILURES, Retry
from tunefleet.platform.status import JobStatus, transition
from tunefleet.workers.backend import RayBackend

log = logging.getLogger(__name__)
S = JobStatus

# The controller's writes: a session that commits only while it holds the lease.
Writing = Callable[[], contextlib.AbstractContextManager[Session]]

# A paused run checkpoints and exits at its next step; past this it is stopped outright.
PAUSE_GRACE_S = 120


@contextlib.contextmanager
def moved_on(job_id: str) -> Iterator[None]:
    """Skip a job that someone else moved first (a cancel or pause racing this pass):
    the compare-and-set lost, nothing was written, the next pass sees the new state."""
    try:
        yield
    except Conflict as exc:
        log.info("job %s moved on: %s", job_id, exc.message)


def failpoint(name: str) -> None:
    """Die here, as ``kill -9`` would kill us, when ``TUNEFLEET_FAILPOINT`` names this point."""
    if os.environ.get("TUNEFLEET_FAILPOINT") == name:
        log.warning("failpoint %s: SIGKILL", name)
        os.kill(os.getpid(), signal.SIGKILL)


def fail_unreadable(writing: Writing, job_id: str, status: JobStatus, exc: ValidationError) -> None:
    """Fail a job whose stored spec no longer validates (a value stored before a bound
    existed), naming what is wrong; the other jobs go on."""
    problems = "; ".join(
        f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:5]
    )
    with moved_on(job_id), writing() as s:
        transition(
            s,
            job_id,
            status,
            S.FAILED,
            f"The job's settings are invalid: {problems}; create the job again with valid values",
            level="error",
            error={"code": "invalid_spec", "message": problems, "param": "tunefleet"},
        )


def retry_later(
    writing: Writing, backend: RayBackend, job_id: str, sid: str, retry: Retry, message: str
) -> None:
    """Requeue a job whose run failed (or that Ray refused to take), to start again after
    a backoff; the next run restores the newest checkpoint."""
    tail = backend.run_logs_tail(sid)
    log.warning(
        "run %s of job %s failed (%s); retrying in %ss (failure %d of %d)%s",
        sid, job_id, message or "no message", retry.delay_s, retry.failures,
        MAX_RUN_FAILURES, f"; its last log lines:\n{tail}" if tail else "",
    )  # fmt: skip
    with writing() as s:
        transition(
            s,
            job_id,
            S.RUNNING,
            S.QUEUED,
            f"Ray job {sid} failed ({message or 'no message'}); retrying from the newest "
            f"checkpoint in {retry.delay_s}s (failure {retry.failures} of "
            f"{MAX_RUN_FAILURES})",
            level="warn",
            data={
                "ray_submission_id": sid,
                "failures": retry.failures,
                "retry_in_s": retry.delay_s,
            },
            failures=retry.failures,
            not_before=now_s() + retry.delay_s,
            placement=None,
        )
