"""Following, the controller's step that follows each running job's run on Ray to its end:
a succeeded run's job succeeds once its base model is served (its adapter and results
file recorded), a failed run is retried after a backoff or fails its job
(``scheduler.after_failure``), a run on a node that left or is being drained has its job
queued again (no retry spent), and a run Ray does not know (a crash between dispatch's
commit and its submit) is submitted again under the same id. What goes wrong while
following one job is said on that job alone (``Controller._job_alone``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from tunefleet.platform import results
from tunefleet.platform.artifacts import Store
from tunefleet.platform.db import Adapter, File, Job, JobEvent, Tenant, now_s, session_scope
from tunefleet.platform.errors import Conflict
from tunefleet.platform.ids import new_id
from tunefleet.platform.lease import LeaseLost
from tunefleet.platform.scheduler import after_failure, serving_mode
from tunefleet.platform.spec import JobSpec, fine_tuned_model_name
from tunefleet.platform.status import JobStatus, add_event, transition
from tunefleet.workers._steps import Writing, failpoint, moved_on, retry_later
from tunefleet.workers.backend import FAILED, NOT_FOUND, STOPPED, SUCCEEDED, RayBackend

log = logging.getLogger(__name__)
S = JobStatus


class Following:
    """The running jobs followed, through the controller's relay, submit and serving."""

    def __init__(
        self,
        backend: RayBackend,
        store: Store,
        db_url: str,
        writing: Writing,
        *,
        relay: Callable[[str, str], bool],
        job_alone: Callable[[str], contextlib.AbstractContextManager[None]],
        submit: Callable[[str, str], None],
        ensure_served: Callable[[str], bool],
        prefetch: Callable[[str, str], tuple[str, dict[str, Any]] | None],
    ):
        self.backend = backend
        self.store = store
        self.db_url = db_url
        self.writing = writing
        self.relay = relay
        self.job_alone = job_alone
        self.submit = submit
        self.ensure_served = ensure_served
        self.prefetch = prefetch

    def follow(self) -> None:
        """Look at each running job's run once and act on what Ray says of it."""
        with session_scope(self.db_url) as s:
            jobs = list(
                s.execute(
                    select(Job.id, Job.ray_submission_id, Job.placement).where(
                        Job.status == S.RUNNING.value
                    )
                )
            )
        # Ray's live nodes and those being drained, asked once a pass if needed
        alive: list[set[str]] = []
        draining: list[dict[str, float]] = []

        def placed_on(placement: dict[str, Any] | None) -> list[str]:
            placed = (placement or {}).get("nodes") or []
            if placed and not alive:
                alive.append({n.id for n in self.backend.nodes()})
                draining.append(self.backend.draining_nodes())
            return placed

        for job_id, sid, placement in jobs:
            if sid is None:
                continue
            with moved_on(job_id), self.job_alone(job_id):
                info = self.backend.run_status(sid)
                placed = placed_on(placement)
                if info.status == SUCCEEDED:
                    self.relay(job_id, sid)  # its last words first
                    self._succeed(job_id)
                elif info.status in (FAILED, STOPPED):
                    self.relay(job_id, sid)  # the error it recorded, if any
                    self._run_failed(job_id, sid, ray_reason(info.message))
                elif lost := sorted(set(placed) - alive[0]) if placed else []:
                    # also a run Ray no longer knows whose nodes went with it (a restarted
                    # embedded Ray has new ones): placed again, not submitted there again
                    self._node_lost(job_id, sid, lost)
                elif drained := sorted(set(placed) & draining[0].keys()) if placed else []:
                    self._node_draining(job_id, sid, {n: draining[0][n] for n in drained})
                elif info.status == NOT_FOUND:
                    log.warning("run %s of %s is unknown to Ray; submitting it", sid, job_id)
                    self.submit(job_id, sid)
                else:
                    failpoint("follow.running")

    def _node_lost(self, job_id: str, sid: str, lost: list[str]) -> None:
        """A node the run was placed on left the cluster (a machine lost, a pod evicted):
        its workers cannot come back there, so the run is stopped and the job queued again
        at once, to continue from its newest checkpoint wherever the scheduler places it
        now. The job's failure count is left alone: the job did nothing wrong."""
        self.relay(job_id, sid)  # what it said before it was cut off
        log.warning("run %s of job %s lost node(s) %s; placing the job again", sid, job_id, lost)
        self.backend.stop_run(sid)
        with self.writing() as s:
            transition(
                s,
                job_id,
                S.RUNNING,
                S.QUEUED,
                f"Node(s) {', '.join(lost)} left the Ray cluster while Ray job {sid} ran "
                "there; it was stopped, and the job continues from its newest checkpoint "
                "on the nodes the scheduler picks next",
                level="warn",
                data={"ray_submission_id": sid, "lost_nodes": lost},
                placement=None,
            )

    def _node_draining(self, job_id: str, sid: str, drained: dict[str, float]) -> None:
        """A node the run is on is being drained: a preemption notice, a pod terminating
        (the chart's preStop hook drains its node), a scale-down. The job is queued again
        now, which tells its run to checkpoint at its next step and leave (as a pause
        does, ``progress.wanted_stop``); the scheduler places it again, off the draining
        nodes, once that run has left (``Dispatching._previous_run_active``), and it
        resumes from that checkpoint. This is not a failure: no retry is spent."""
        now = time.time()
        notice = ", ".join(
            f"{node} (deadline in {max(0, deadline - now):.0f} s)" if deadline else node
            for node, deadline in sorted(drained.items())
        )
        log.warning("run %s of job %s is on draining node(s) %s", sid, job_id, notice)
        with self.writing() as s:
            transition(
                s,
                job_id,
                S.RUNNING,
                S.QUEUED,
                f"Node(s) {notice} are being drained (preempted or removed) while Ray job "
                f"{sid} runs there; it checkpoints at its next step and stops, and the job "
                "resumes from that checkpoint on other nodes",
                level="warn",
                data={"ray_submission_id": sid, "draining_nodes": drained},
                placement=None,
            )

    def _run_failed(self, job_id: str, sid: str, message: str) -> None:
        """A run failed: retry it after a backoff, or fail the job with the error the run
        recorded (``scheduler.after_failure`` decides)."""
        with session_scope(self.db_url) as s:
            failures = s.scalar(select(Job.failures).where(Job.id == job_id)) or 0
            recorded = _recorded_error(s, job_id)
        retry = after_failure(failures, recorded.get("code") if recorded else None)
        if retry is not None:
            retry_later(self.writing, self.backend, job_id, sid, retry, message)
        else:
            self._fail(job_id, sid, message)

    def _succeed(self, job_id: str) -> None:
        key = self.store.adapter_key(job_id)
        if not self.store.exists(key):
            self._fail(job_id, None, f"the run ended without an adapter at {key}")
            return
        with session_scope(self.db_url) as s:
            job = s.get(Job, job_id)
            assert job is not None
            base, tenant_id = job.model, job.tenant_id
        # Serving first: a job reads succeeded only once its model answers.
        if not self.ensure_served(base):
            return  # its model server is still starting: a later pass looks again
        # Then its adapter on the serving nodes (Serving.prefetch_before_success)
        prefetched = self.prefetch(base, job_id)
        if prefetched is None:
            return  # still copying: a later pass looks again
        # The results file's object before the rows naming it: a crash between the two
        # leaves an object nothing names (the next pass writes another), never a row
        # naming nothing; the job succeeds with its File row in one transaction.
        step_metrics = self._write_results(job_id, tenant_id)
        try:
            with self.writing() as s:
                job = s.get(Job, job_id)
                assert job is not None
                tenant = s.get(Tenant, job.tenant_id)
                assert tenant is not None
                spec = JobSpec.model_validate(job.spec)
                name = fine_tuned_model_name(job.model, tenant.name, spec.suffix, job.id)
                s.add(
                    Adapter(
                        id=new_id("adapter"),
                        tenant_id=job.tenant_id,
                        job_id=job.id,
                        name=name,
                        base_model=job.model,
                        path=key,
                        serving_mode=serving_mode(spec.tunefleet.method),
                    )
                )
                s.add(step_metrics)
                if prefetched[0]:
                    add_event(s, job_id, prefetched[0], data=prefetched[1])
                transition(
                    s,
                    job_id,
                    S.RUNNING,
                    S.SUCCEEDED,
                    f"The job has successfully completed; fine-tuned model {name}",
                    fine_tuned_model=name,
                    estimated_finish=None,
                    result_files=[step_metrics.id],
                )
        except (Conflict, LeaseLost):
            # nothing was committed (the job moved on; this controller was deposed)
            self.store.delete(step_metrics.path)
            raise

    def _write_results(self, job_id: str, tenant_id: str) -> File:
        """Write the job's results file (``platform/results.py``) from its metrics events
        into the artifact store; its File row, for the caller to add."""
        with session_scope(self.db_url) as s:
            events = s.scalars(
                select(JobEvent.data)
                .where(JobEvent.job_id == job_id, JobEvent.type == "metrics")
                .order_by(JobEvent.seq)
            )
            content = results.step_metrics_csv(data for data in events if data)
        file_id = new_id("file")
        key = self.store.results_key(file_id)
        self.store.write_bytes(key, content)
        return File(
            id=file_id,
            tenant_id=tenant_id,
            filename=results.FILENAME,
            purpose=results.PURPOSE,
            bytes=len(content),
            status="processed",
            format=results.FORMAT,
            stats={},
            path=key,
            created_at=now_s(),
        )

    def _fail(self, job_id: str, sid: str | None, message: str) -> None:
        with self.writing() as s:
            recorded = _recorded_error(s, job_id)
            error: dict[str, Any]
            if recorded is not None:
                error = dict(recorded)
            else:  # the run said nothing: its log lines are the operator's, not the tenant's
                tail = self.backend.run_logs_tail(sid) if sid else ""
                if tail:
                    log.warning(
                        "run %s of job %s failed; its last log lines:\n%s", sid, job_id, tail
                    )
                where = f" (Ray job {sid}; its logs are in Ray's job logs)" if sid else ""
                error = {"code": "training_failed", "message": f"{message}{where}"}
            error.setdefault("param", None)
            transition(
                s,
                job_id,
                S.RUNNING,
                S.FAILED,
                f"Job failed: {error['message'][:500]}",
                level="error",
                error=error,
            )


def _recorded_error(s: Session, job_id: str) -> dict[str, Any] | None:
    """The error the job's newest error event carries (a run records its own failure)."""
    data = s.scalar(
        select(JobEvent.data)
        .where(JobEvent.job_id == job_id, JobEvent.level == "error")
        .order_by(JobEvent.seq.desc())
        .limit(1)
    )
    return data["error"] if data and "error" in data else None


def ray_reason(message: str) -> str:
    """What Ray says about a failed run, less the log lines it appends (the run's output:
    paths, environment, other libraries' messages), which are the operator's to read in
    Ray's job logs, not something to show a tenant."""
    reason = message.split("last available logs", 1)[0].strip().rstrip(",").strip()
    reason = reason.splitlines()[0] if reason else ""
    return reason[:300] or "the run ended without a message"
