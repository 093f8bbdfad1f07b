"""Dispatch, the controller's step that applies the scheduling policy
(``platform.scheduler.plan``): start the queued jobs it picks on the nodes it picks, tell
the others their place in the queue and why, fail the ones that can never fit, and say
which wait for nodes Ray's autoscaler can add (``_capacity.py`` asks for them).

The order is the crash-safe one: the decisions are written (and committed) first, then
each started run is submitted to Ray under the idempotent id ``{job_id}-{attempt}``
(``submit``), so a crash between the two leaves a running job whose run Ray does not know,
which following (``_following.py``) submits again under the same id.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from tunefleet.platform.artifacts import Store
from tunefleet.platform.db import Checkpoint, Job, JobEvent, Tenant, now_s, session_scope
from tunefleet.platform.lease import LeaseLost
from tunefleet.platform.metrics import DISPATCH_WAIT
from tunefleet.platform.models import ModelRegistry
from tunefleet.platform.scheduler import (
    Dispatch,
    Grow,
    Node,
    QueuedJob,
    Reject,
    RunningJob,
    Snapshot,
    TenantQuota,
    Wait,
    after_failure,
    plan,
)
from tunefleet.platform.settings import Settings
from tunefleet.platform.spec import Resources
from tunefleet.platform.status import JobStatus, add_event, transition
from tunefleet.workers._capacity import CapacityRequests
from tunefleet.workers._steps import (
    PAUSE_GRACE_S,
    Writing,
    fail_unreadable,
    failpoint,
    moved_on,
    retry_later,
)
from tunefleet.workers.backend import NOT_FOUND, TERMINAL_RAY, RayBackend

log = logging.getLogger(__name__)
S = JobStatus


class Dispatching:
    """The policy's decisions applied, and the queue position each waiting job was last
    told."""

    def __init__(
        self,
        settings: Settings,
        backend: RayBackend,
        store: Store,
        registry: ModelRegistry,
        capacity: CapacityRequests,
        db_url: str,
        writing: Writing,
        open_channel: Callable[[str, dict[str, Any]], None],
        prepare_serving: Callable[[str], None],
    ):
        self.settings = settings
        self.backend = backend
        self.store = store
        self.registry = registry
        self.capacity = capacity
        self.db_url = db_url
        self.writing = writing
        self.open_channel = open_channel  # the controller's: its relay forgets the run
        self.prepare_serving = prepare_serving  # Serving.prepare: the model loads meanwhile
        self._waiting: dict[str, str] = {}  # job id -> the last "Waiting in queue" written

    def dispatch(self) -> tuple[dict[str, Grow], list[dict[str, float]]]:
        """Apply the scheduling policy; what the jobs that wait for nodes need (for
        ``CapacityRequests.ask``): each one's ``Grow``, and the running jobs' worker
        bundles."""
        now = time.time()
        started: list[tuple[str, str]] = []
        growing: dict[str, Grow] = {}
        running: list[dict[str, float]] = []
        with self.writing() as s:
            queued = list(
                s.scalars(
                    select(Job)
                    .where(Job.status == S.QUEUED.value)
                    .order_by(Job.priority.desc(), Job.created_ns, Job.id)
                )
            )
            for job in [j for j in queued if _resources(j) is None]:
                queued.remove(job)
                try:
                    Resources.model_validate(_stored_resources(job))
                except ValidationError as exc:
                    fail_unreadable(self.writing, job.id, S.QUEUED, exc)
            jobs = {j.id: j for j in queued}
            self._waiting = {k: v for k, v in self._waiting.items() if k in jobs}
            # asked for every pass, queue or not: a request without a running job's
            # workers lets the autoscaler take its node back as idle while Ray starts the
            # run (seen in the elastic test: three runs in a row lost their new node)
            running = self._running_bundles(s)
            if queued:
                snapshot = self._snapshot(s, queued)
                for decision in plan(snapshot, now):
                    job = jobs[decision.job_id]
                    with moved_on(job.id):
                        if isinstance(decision, Dispatch):
                            if self._previous_run_active(s, job):
                                continue
                            started.append((job.id, self._start(s, job, decision)))
                            # its workers count as running from this pass on: its node is
                            # idle until Ray places the run, and a request without them
                            # let the autoscaler take it back (seen: 6 s idle in a CI run)
                            running.extend(_queued(job).bundles())
                        elif isinstance(decision, Wait) and decision.grow is not None:
                            if self._wait_for_nodes(s, job.id, decision, now):
                                growing[job.id] = decision.grow
                        elif isinstance(decision, Wait):
                            self._note_queue_position(s, job.id, decision.position, decision.reason)
                        elif isinstance(decision, Reject):
                            transition(
                                s,
                                job.id,
                                S.QUEUED,
                                S.FAILED,
                                f"The job cannot run on this cluster: {decision.reason}",
                                level="error",
                                error={
                                    "code": "does_not_fit_cluster",
                                    "message": decision.reason,
                                    "param": "tunefleet.resources",
                                },
                            )
        failpoint("dispatch.after_commit")
        # Submit after the commit: a crash here leaves a running job whose Ray job is
        # NOT_FOUND, which following submits again under the same id.
        for job_id, sid in started:
            self.submit(job_id, sid)
        return growing, running

    def _wait_for_nodes(self, s: Session, job_id: str, wait: Wait, now: float) -> bool:
        """A job waits for nodes the autoscaler can add: say so with when they were asked
        for, or fail it when it has waited past ``capacity_wait_s``; whether it waits."""
        assert wait.grow is not None
        since = self.capacity.since(s, job_id, now)
        if (overdue := self.capacity.overdue(job_id, now)) is not None:
            transition(
                s,
                job_id,
                S.QUEUED,
                S.FAILED,
                f"The job failed waiting for capacity: {overdue}",
                level="error",
                error={"code": "capacity_timeout", "message": overdue, "param": None},
            )
            return False
        reason, data = self.capacity.reason(wait.grow, since)
        self._note_queue_position(s, job_id, wait.position, reason, data)
        return True

    @staticmethod
    def _running_bundles(s: Session) -> list[dict[str, float]]:
        """The running jobs' worker bundles: what a request for more nodes must hold beside
        the waiting jobs'."""
        return [
            bundle
            for job in s.scalars(select(Job).where(Job.status == S.RUNNING.value))
            if _resources(job) is not None
            for bundle in _queued(job).bundles()
        ]

    def _snapshot(self, s: Session, queued: list[Job]) -> Snapshot:
        """The policy's view: queued and running jobs, quotas, the node types the cluster
        can add, and each live Ray node's free capacity: the smaller of its total less what
        TuneFleet's running jobs were placed on (runs just dispatched that Ray has not yet
        started count) and what Ray reports free (work outside TuneFleet counts). Nodes
        being drained take no new work."""
        draining = self.backend.draining_nodes()
        nodes = [n for n in self.backend.nodes() if n.id not in draining]
        held: dict[str, dict[str, float]] = {n.id: {} for n in nodes}
        running: list[RunningJob] = []
        for job in s.scalars(select(Job).where(Job.status == S.RUNNING.value)):
            res = _resources(job)
            if res is None:  # cannot have started: counts for nothing
                continue
            bundle = _queued(job).bundle()
            for node_id in (job.placement or {}).get("nodes", []):
                if node_id in held:
                    for name, amount in bundle.items():
                        held[node_id][name] = held[node_id].get(name, 0.0) + amount
            running.append(
                RunningJob(
                    job.id,
                    job.tenant_id,
                    res.num_workers * res.cpus_per_worker,
                    res.num_workers * res.gpus_per_worker,
                )
            )
        tenants = {
            t.id: TenantQuota(t.id, t.max_concurrent_jobs, t.max_gpus)
            for t in s.scalars(select(Tenant))
        }

        def free(total: float, reported: float | None, name: str, node_id: str) -> float:
            left = total - held[node_id].get(name, 0.0)
            return max(0.0, left if reported is None else min(left, reported))

        live = []
        for n in nodes:
            reported = n.free_resources or {}
            live.append(
                Node(
                    n.id,
                    n.cpus,
                    n.gpus,
                    free_cpus=free(n.cpus, n.free[0], "CPU", n.id),
                    free_gpus=free(n.gpus, n.free[1], "GPU", n.id),
                    resources=n.resources,
                    free_resources={
                        k: free(v, reported.get(k, v), k, n.id) for k, v in n.resources.items()
                    },
                )
            )
        return Snapshot(
            queued=[_queued(job) for job in queued],
            running=running,
            tenants=tenants,
            nodes=live,
            node_types=self.backend.node_types(),
        )

    def _previous_run_active(self, s: Session, job: Job) -> bool:
        """Whether the job's previous run still runs (a pause then resume faster than the
        run saw the pause): one run per job at a time, so the next starts once it has
        checkpointed and left, which it does at its next step since the job is no longer
        running; past ``PAUSE_GRACE_S`` it is stopped."""
        previous = job.ray_submission_id
        if previous is None:
            return False
        if self.backend.run_status(previous).status in TERMINAL_RAY | {NOT_FOUND}:
            return False
        if now_s() - job.updated_at > PAUSE_GRACE_S:
            self.backend.stop_run(previous)
        self._note_queue_position(
            s, job.id, 1, f"its previous run (Ray job {previous}) is checkpointing and stopping"
        )
        return True

    @staticmethod
    def _start(s: Session, job: Job, decision: Dispatch) -> str:
        DISPATCH_WAIT.observe(max(0, now_s() - job.updated_at))  # queued since its last move
        sid = f"{job.id}-{job.attempt + 1}"
        nodes = list(decision.nodes)
        step = s.scalar(select(func.max(Checkpoint.step)).where(Checkpoint.job_id == job.id))
        resumes = f"; it resumes from the checkpoint at step {step}" if step else ""
        transition(
            s,
            job.id,
            S.QUEUED,
            S.RUNNING,
            f"Dispatched as Ray job {sid} to node(s) {', '.join(sorted(set(nodes)))}{resumes}",
            data={"ray_submission_id": sid, "attempt": job.attempt + 1, "nodes": nodes},
            attempt=job.attempt + 1,
            ray_submission_id=sid,
            placement={"nodes": nodes},
            not_before=None,
        )
        return sid

    def _note_queue_position(
        self,
        s: Session,
        job_id: str,
        position: int,
        reason: str,
        data: dict[str, Any] | None = None,
    ) -> None:
        """Tell a waiting job its position and why, when either changed (the job's last
        event is read once per controller, then remembered)."""
        message = f"Waiting in queue at position {position}: {reason}"
        if self._waiting.get(job_id) == message:
            return
        if job_id not in self._waiting:
            self._waiting[job_id] = (
                s.scalar(
                    select(JobEvent.message)
                    .where(JobEvent.job_id == job_id)
                    .order_by(JobEvent.seq.desc())
                    .limit(1)
                )
                or ""
            )
        if self._waiting[job_id] != message:
            add_event(
                s,
                job_id,
                message,
                data={"queue_position": position, "reason": reason, **(data or {})},
            )
            self._waiting[job_id] = message

    def submit(self, job_id: str, sid: str) -> None:
        """Hand run ``sid`` of a running job to Ray, its channel opened first (a submit
        Ray already has is not repeated: ``RayBackend.submit_run``)."""
        with session_scope(self.db_url) as s:
            job = s.get(Job, job_id)
            assert job is not None
            inputs = run_inputs(job)
            base_model = job.model
        env = {  # never a credential: Ray's Jobs API shows it to whoever holds the token
            "TUNEFLEET_ARTIFACT_ROOT": self.store.location,
            "TUNEFLEET_S3_ENDPOINT_URL": self.settings.s3_endpoint_url,
            "TUNEFLEET_S3_REGION": self.settings.s3_region,
            "TUNEFLEET_MODEL_REGISTRY": str(self.registry.root),
            "TUNEFLEET_RUN_ID": sid,
        }
        if point := os.environ.get("TUNEFLEET_FAILPOINT"):  # the fault tests' runs too
            env["TUNEFLEET_FAILPOINT"] = point
        try:
            self.open_channel(sid, inputs)
            self.backend.submit_run(sid, job_id, env)
            failpoint("dispatch.after_submit")
            with self.writing() as s:
                add_event(s, job_id, f"Ray job {sid} submitted", data={"ray_submission_id": sid})
        except LeaseLost:
            raise
        except Exception as exc:  # Ray's Jobs API can refuse for a while ("no agent")
            log.warning("submitting %s of %s failed: %s", sid, job_id, exc)
            with moved_on(job_id):
                self._submit_refused(job_id, sid, f"could not submit to Ray: {exc}")
            return
        self.prepare_serving(base_model)

    def _submit_refused(self, job_id: str, sid: str, message: str) -> None:
        """Ray refused to take a run (its Jobs API says "no available agent" for a while
        after a node starts): retried as a failed run is, then the job fails with
        ``dispatch_failed``."""
        with session_scope(self.db_url) as s:
            failures = s.scalar(select(Job.failures).where(Job.id == job_id)) or 0
        retry = after_failure(failures)
        if retry is not None:
            retry_later(self.writing, self.backend, job_id, sid, retry, message)
            return
        with self.writing() as s:
            transition(
                s,
                job_id,
                S.RUNNING,
                S.FAILED,
                f"Job failed: {message}",
                level="error",
                error={"code": "dispatch_failed", "message": message, "param": None},
                failures=failures + 1,
            )


def run_inputs(job: Job) -> dict[str, Any]:
    """What a run gets from its channel (it never reads the database): the spec as the API
    stored it, the device its plan is for (a micro-batch probe on CPU workers), and the
    node of each worker the scheduler placed it on."""
    return {
        "spec": job.spec,
        "device_memory_bytes": (job.plan or {}).get("device", {}).get("memory_bytes"),
        "nodes": (job.placement or {}).get("nodes"),
    }


def _stored_resources(job: Job) -> Any:
    return (job.spec or {}).get("tunefleet", {}).get("resources", {})


def _resources(job: Job) -> Resources | None:
    """The job's resources, read from its stored spec without validating the whole spec
    (the scheduler reads every queued and running job on every pass); None when they do not
    validate."""
    try:
        return Resources.model_validate(_stored_resources(job))
    except ValidationError:
        return None


def _queued(job: Job) -> QueuedJob:
    res = _resources(job)
    assert res is not None  # unreadable jobs were failed before planning
    return QueuedJob(
        id=job.id,
        tenant_id=job.tenant_id,
        created_ns=job.created_ns,
        priority=job.priority,
        workers=res.num_workers,
        cpus_per_worker=res.cpus_per_worker,
        gpus_per_worker=res.gpus_per_worker,
        not_before=job.not_before,
        resources_per_worker=res.custom_resources_per_worker,
    )
