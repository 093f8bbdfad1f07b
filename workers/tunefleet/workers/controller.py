"""The controller: one loop that moves jobs through their life on Ray.

Each pass: write what runs reported through their channels (``workers/_run_channel.py``:
runs never touch the database) and tell them whether to stop, admit jobs whose files are
validated (``validating_files -> queued``), follow running jobs to their end (retrying
failed runs with backoff), let the scheduling policy
(``tunefleet.platform.scheduler.plan``) decide which queued jobs start and where, apply
those decisions, and stop the Ray jobs of cancelled or paused ones. Only the holder of the
controller lease (``tunefleet.platform.lease``) runs passes; a standby takes over when the
leader stops renewing it.

Crash safety: status moves through ``status.transition`` (compare-and-set), so an API
cancel racing a dispatch can never both win. The database write comes before the Ray
submit, and a run's submission id is ``{job_id}-{attempt}``, so a crash at any point is
repaired on the next pass: a running job whose run Ray does not know is submitted again
under the same id (Ray Train then restores the newest checkpoint), and a submit that Ray
already has is not repeated. ``TUNEFLEET_FAILPOINT`` names a point at which the process
kills itself with SIGKILL, for the fault-injection tests.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import httpx
from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session

from tunefleet.platform import results
from tunefleet.platform.artifacts import artifact_store
from tunefleet.platform.db import Adapter, File, Job, JobEvent, Tenant, now_s, session_scope
from tunefleet.platform.errors import Conflict
from tunefleet.platform.ids import new_id
from tunefleet.platform.lease import Lease, LeaseLost
from tunefleet.platform.metrics import DISPATCH_WAIT, PASS_SECONDS
from tunefleet.platform.models import ModelRegistry
from tunefleet.platform.progress import apply, wanted_stop
from tunefleet.platform.scheduler import (
    MAX_RUN_FAILURES,
    Dispatch,
    Node,
    QueuedJob,
    Reject,
    Retry,
    RunningJob,
    Snapshot,
    TenantQuota,
    Wait,
    after_failure,
    plan,
    serving_mode,
)
from tunefleet.platform.serving import serving_config
from tunefleet.platform.settings import Settings
from tunefleet.platform.spec import JobSpec, Resources, fine_tuned_model_name
from tunefleet.platform.status import JobStatus, add_event, transition
from tunefleet.workers._webhook_sender import send_due
from tunefleet.workers.backend import (
    FAILED,
    NOT_FOUND,
    STOPPED,
    SUCCEEDED,
    TERMINAL_RAY,
    RayBackend,
)

log = logging.getLogger(__name__)
S = JobStatus


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


# A paused run checkpoints and exits at its next step; past this it is stopped outright.
PAUSE_GRACE_S = 120
# A run Ray does not know while its job has moved on keeps its channel this long: a submit
# that raised (the Jobs API's head timing out on its agent under load) may still have been
# taken, and the run, once it starts, must find its channel to learn that it is to stop.
UNKNOWN_RUN_GRACE_S = 60.0
# A base model whose Serve application failed to deploy is tried again after this long.
SERVE_RETRY_S = 60


class Controller:
    # A pass waits this long for the files it handed to the admission thread.
    ADMISSION_WAIT_S = 2.0
    # Counting one job's files in tokens may take this long, then the job fails.
    ADMISSION_TIMEOUT_S = 900.0
    # A pass waits this long for a Serve deploy; past SERVE_SLOW_S its jobs say so.
    SERVE_WAIT_S = 2.0
    SERVE_SLOW_S = 600.0

    def __init__(self, settings: Settings, backend: RayBackend, *, lease: Lease | None = None):
        self.settings = settings
        self.backend = backend
        self.lease = lease
        self.db_url = settings.resolved_database_url
        self.store = artifact_store(settings)
        self.registry = ModelRegistry(settings.resolved_model_registry)
        self._served: set[str] = set()
        self._tokenizers: dict[str, Any] = {}  # used on the admission thread only
        self._admission = futures.ThreadPoolExecutor(1, thread_name_prefix="admission")
        self._closing = threading.Event()
        self._admitting: dict[str, futures.Future[dict[str, dict[str, int]]]] = {}
        self._waiting: dict[str, str] = {}  # job id -> the last "Waiting in queue" written
        self._trouble: dict[str, str] = {}  # job id -> the last trouble said on it
        # base model -> (monotonic time of the next try, why the last one failed)
        self._serve_failed: dict[str, tuple[float, str]] = {}
        # base model -> (monotonic start, the deploy on the serving thread)
        self._serving = futures.ThreadPoolExecutor(1, thread_name_prefix="serving")
        self._deploying: dict[str, tuple[float, futures.Future[str]]] = {}
        self._asked: dict[str, dict[str, Any] | None] = {}  # run id -> the stop it was told
        self._unknown: dict[str, float] = {}  # run id -> when Ray first did not know it
        # base model -> the serving configuration its replicas last applied, and the push
        # in flight on its own thread (a merge takes seconds)
        self._pushed: dict[str, dict[str, list[str]]] = {}
        self._push_pool = futures.ThreadPoolExecutor(1, thread_name_prefix="serving-config")
        self._pushing: futures.Future[None] | None = None
        self._next_push = 0.0
        # the webhook outbox, sent on its own thread: a slow endpoint holds up no pass
        self._webhook_pool = futures.ThreadPoolExecutor(1, thread_name_prefix="webhooks")
        self._sending: futures.Future[int] | None = None
        self._http = httpx.Client(follow_redirects=False)
        self.leading = False
        self.last_round = time.monotonic()  # the end of the loop's last round (``health``)

    # -- the loop --------------------------------------------------------------------
    def run_forever(self, stop: threading.Event) -> None:
        """Run passes until ``stop`` while this controller holds the lease (always, without
        one); hand the lease back on the way out."""
        leading = False
        try:
            while not stop.is_set():
                try:
                    if self.lease is None or self.lease.acquire():
                        if not leading:
                            leading = True
                            term = self.lease.term if self.lease else None
                            log.info("controller leads (term %s)", term)
                            self.serve_existing_adapters()
                            self._reattach(term)
                        with PASS_SECONDS.time():
                            self.tick()
                    elif leading:
                        leading = False
                        log.warning("controller lost the lease; standing by")
                except LeaseLost as exc:  # deposed mid-pass: the pass's writes rolled back
                    leading = False
                    log.warning("controller lost the lease mid-pass (%s); standing by", exc)
                except Exception:  # top of the loop: log, keep the controller alive
                    log.exception("controller pass failed")
                self.leading, self.last_round = leading, time.monotonic()
                stop.wait(self.settings.controller_interval_s)
        finally:
            self._closing.set()  # a count in progress stops at its next line
            self._admission.shutdown(wait=True, cancel_futures=True)
            self._serving.shutdown(wait=False, cancel_futures=True)  # a deploy may never end
            self._push_pool.shutdown(wait=False, cancel_futures=True)
            self._webhook_pool.shutdown(wait=False, cancel_futures=True)
            if self.lease is not None:
                self.lease.release()

    def health(self) -> tuple[bool, dict[str, Any]]:
        """Healthy while the loop goes round (leading or standing by): a round that has not
        ended for longer than the lease lasts means the controller is stuck."""
        age = time.monotonic() - self.last_round
        limit = max(self.settings.controller_lease_ttl_s, 10 * self.settings.controller_interval_s)
        term = self.lease.term if self.lease is not None and self.leading else None
        return age < limit, {
            "leading": self.leading,
            "term": term,
            "last_round_s_ago": round(age, 3),
        }

    @contextlib.contextmanager
    def _writing(self) -> Iterator[Session]:
        """A session for the controller's writes, fenced by the lease: it commits only while
        this controller holds the lease at the term it won (``Lease.fence``), so a leader
        deposed mid-pass changes nothing its successor now owns. Reads use plain
        sessions."""
        with session_scope(self.db_url) as s:
            yield s
            if self.lease is not None:
                self.lease.fence(s)

    def _reattach(self, term: int | None) -> None:
        """On taking the lead, say on each running job that its run is followed again."""
        with session_scope(self.db_url) as s:
            running = list(
                s.execute(
                    select(Job.id, Job.ray_submission_id).where(Job.status == S.RUNNING.value)
                )
            )
        for job_id, sid in running:
            status = self.backend.run_status(sid).status if sid else NOT_FOUND
            with self._writing() as s:
                add_event(
                    s,
                    job_id,
                    f"Controller (term {term}) re-attached to Ray job {sid} ({status})",
                    data={"ray_submission_id": sid, "ray_status": status, "term": term},
                )

    def tick(self) -> None:
        self._relay_runs()
        self._admit()
        self._follow_running()
        self._dispatch()
        self._stop_unwanted_runs()
        self._push_serving()
        self._send_webhooks()

    # -- steps -----------------------------------------------------------------------
    def _admit(self) -> None:
        """Count each new job's files in its base model's tokens, then queue it (or fail
        it with the reason when a file cannot be used).

        Counting runs on the admission thread, off the pass: a pass hands it the new jobs,
        waits for them up to ``ADMISSION_WAIT_S`` (small files are done by then), and takes
        the rest on a later pass, so one tenant's large file never holds up the others'
        dispatch or the lease's renewal. A file whose counting runs past
        ``ADMISSION_TIMEOUT_S`` fails its job."""
        with session_scope(self.db_url) as s:
            pending = list(s.scalars(select(Job).where(Job.status == S.VALIDATING_FILES.value)))
            for job in pending:
                s.expunge(job)
        waiting = {job.id for job in pending}
        self._admitting = {k: v for k, v in self._admitting.items() if k in waiting}
        for job in pending:
            if job.id in self._admitting:
                continue
            try:
                spec = JobSpec.model_validate(job.spec)
            except ValidationError as exc:  # stored before a bound existed: this job alone
                self._fail_unreadable(job.id, S.VALIDATING_FILES, exc)
                continue
            files = {"training_file": job.training_file, "validation_file": job.validation_file}
            self._admitting[job.id] = self._admission.submit(
                self._count_files, job.model, spec.tunefleet.max_seq_len, files
            )
        futures.wait(list(self._admitting.values()), timeout=self.ADMISSION_WAIT_S)
        for job_id, counted in list(self._admitting.items()):
            if not counted.done():
                continue
            del self._admitting[job_id]
            try:
                stats = counted.result()
            except Exception as exc:  # any unreadable file fails this job, not the loop
                with moved_on(job_id), self._writing() as s:
                    transition(
                        s,
                        job_id,
                        S.VALIDATING_FILES,
                        S.FAILED,
                        f"File validation failed: {exc}",
                        level="error",
                        error={
                            "code": "invalid_file",
                            "message": str(exc),
                            "param": "training_file",
                        },
                    )
                continue
            train = stats["training_file"]
            with moved_on(job_id), self._writing() as s:
                transition(
                    s,
                    job_id,
                    S.VALIDATING_FILES,
                    S.QUEUED,
                    f"Validated training file: {train['examples']} examples, "
                    f"{train['tokens']} tokens, {train['over_max_seq_len']} longer than "
                    f"{train['max_seq_len']} (truncated); job queued",
                    data=stats,
                    stats=stats,
                )

    def _count_files(
        self, model: str, max_seq_len: int, files: dict[str, str | None]
    ) -> dict[str, dict[str, int]]:
        """On the admission thread: each file's token statistics (see ``_admit``)."""
        deadline = time.monotonic() + self.ADMISSION_TIMEOUT_S

        def check() -> None:  # between two lines of a file
            if self._closing.is_set():
                raise RuntimeError("the controller stopped while counting; counted again later")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"counting the files' tokens took longer than {self.ADMISSION_TIMEOUT_S:.0f}"
                    " s; split the training file into smaller jobs"
                )

        stats = {
            role: self._file_stats(file_id, model, max_seq_len, check)
            for role, file_id in files.items()
            if file_id
        }
        if stats["training_file"]["trained_tokens"] == 0:
            raise ValueError(
                "no example has tokens to learn from (assistant turns with weight 1, "
                "completions or text)"
            )
        return stats

    def _file_stats(
        self, file_id: str, model: str, max_seq_len: int, check: Callable[[], None]
    ) -> dict[str, int]:
        from transformers import AutoTokenizer

        from tunefleet.workers.train.data import token_stats

        path = self.store.local_copy(self.store.file_key(file_id))
        if not path.exists():
            raise FileNotFoundError(f"file {file_id} is no longer in the artifact store")
        if model not in self._tokenizers:
            self._tokenizers[model] = AutoTokenizer.from_pretrained(self.registry.require(model))
        return token_stats(path, self._tokenizers[model], max_seq_len, check=check)

    def _dispatch(self) -> None:
        """Apply the scheduling policy: start the jobs it picks on the nodes it picks, tell
        the others their place in the queue and why, fail the ones that can never fit."""
        now = time.time()
        started: list[tuple[str, str]] = []
        with self._writing() as s:
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
                    self._fail_unreadable(job.id, S.QUEUED, exc)
            jobs = {j.id: j for j in queued}
            self._waiting = {k: v for k, v in self._waiting.items() if k in jobs}
            if not queued:
                return
            snapshot = self._snapshot(s, queued)
            for decision in plan(snapshot, now):
                job = jobs[decision.job_id]
                with moved_on(job.id):
                    if isinstance(decision, Dispatch):
                        if self._previous_run_active(s, job):
                            continue
                        started.append((job.id, self._start(s, job, decision)))
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
        # NOT_FOUND, which _follow_running submits again under the same id.
        for job_id, sid in started:
            self._submit(job_id, sid)

    def _snapshot(self, s: Session, queued: list[Job]) -> Snapshot:
        """The policy's view: queued and running jobs, quotas, and each Ray node's free
        capacity: the smaller of its total less what TuneFleet's running jobs were placed
        on (runs just dispatched that Ray has not yet started count) and what Ray reports
        free (work outside TuneFleet counts)."""
        nodes = self.backend.nodes()
        held: dict[str, list[float]] = {n.id: [0.0, 0.0] for n in nodes}
        running: list[RunningJob] = []
        for job in s.scalars(select(Job).where(Job.status == S.RUNNING.value)):
            res = _resources(job)
            if res is None:  # cannot have started: counts for nothing
                continue
            placed = (job.placement or {}).get("nodes", [])
            for node_id in placed:
                if node_id in held:
                    held[node_id][0] += res.cpus_per_worker
                    held[node_id][1] += res.gpus_per_worker
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
        return Snapshot(
            queued=[_queued(job) for job in queued],
            running=running,
            tenants=tenants,
            nodes=[
                Node(
                    n.id,
                    n.cpus,
                    n.gpus,
                    free_cpus=max(0.0, min(n.cpus - held[n.id][0], n.free[0])),
                    free_gpus=max(0.0, min(n.gpus - held[n.id][1], n.free[1])),
                )
                for n in nodes
            ],
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
        transition(
            s,
            job.id,
            S.QUEUED,
            S.RUNNING,
            f"Dispatched as Ray job {sid} to node(s) {', '.join(sorted(set(nodes)))}",
            data={"ray_submission_id": sid, "attempt": job.attempt + 1, "nodes": nodes},
            attempt=job.attempt + 1,
            ray_submission_id=sid,
            placement={"nodes": nodes},
            not_before=None,
        )
        return sid

    def _note_queue_position(self, s: Session, job_id: str, position: int, reason: str) -> None:
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
            add_event(s, job_id, message, data={"queue_position": position, "reason": reason})
            self._waiting[job_id] = message

    def _submit(self, job_id: str, sid: str) -> None:
        with session_scope(self.db_url) as s:
            job = s.get(Job, job_id)
            assert job is not None
            inputs = run_inputs(job)
        env = {  # never a credential: Ray's Jobs API shows it to whoever holds the token
            "TUNEFLEET_ARTIFACT_ROOT": self.store.location,
            "TUNEFLEET_S3_ENDPOINT_URL": self.settings.s3_endpoint_url,
            "TUNEFLEET_S3_REGION": self.settings.s3_region,
            "TUNEFLEET_MODEL_REGISTRY": str(self.registry.root),
            "TUNEFLEET_RUN_ID": sid,
        }
        if point := os.environ.get("TUNEFLEET_FAILPOINT"):  # the fault tests' runs too
            env["TUNEFLEET_FAILPOINT"] = point
        self._asked.pop(sid, None)  # a channel opened again has been told nothing
        try:
            self.backend.open_channel(sid, inputs)
            self.backend.submit_run(sid, job_id, env)
            failpoint("dispatch.after_submit")
            with self._writing() as s:
                add_event(s, job_id, f"Ray job {sid} submitted", data={"ray_submission_id": sid})
        except LeaseLost:
            raise
        except Exception as exc:  # Ray's Jobs API can refuse for a while ("no agent")
            log.warning("submitting %s of %s failed: %s", sid, job_id, exc)
            with moved_on(job_id):
                self._submit_refused(job_id, sid, f"could not submit to Ray: {exc}")

    def _relay_runs(self) -> None:
        """Every open run channel: write what its run reported, tell it whether to stop;
        close the channel of a run that is no longer its job's running one once Ray says
        it ended (or has not known it for ``UNKNOWN_RUN_GRACE_S``)."""
        for sid in self.backend.open_channels():
            job_id = sid.rsplit("-", 1)[0]
            with moved_on(job_id), self._job_alone(job_id):
                current = self.relay(job_id, sid)
                status = None if current else self.backend.run_status(sid).status
                if status == NOT_FOUND:
                    since = self._unknown.setdefault(sid, time.monotonic())
                    if time.monotonic() - since < UNKNOWN_RUN_GRACE_S:
                        continue
                elif status not in TERMINAL_RAY:
                    self._unknown.pop(sid, None)
                    continue
                self.relay(job_id, sid)  # what it said between the two looks
                self.backend.close_channel(sid)
                log.info("closed the channel of run %s (Ray: %s)", sid, status)
                self._asked.pop(sid, None)
                self._unknown.pop(sid, None)

    def relay(self, job_id: str, sid: str) -> bool:
        """Write what run ``sid`` reported on its job (each record once: ``progress.apply``)
        and tell it whether to stop (``progress.wanted_stop``); whether it is its job's
        running run. Nothing reported: a read, no write."""
        records = self.backend.take(sid)
        with self._writing() if records else session_scope(self.db_url) as s:
            job = s.get(Job, job_id)
            if job is None:  # the job is gone: so is what its run had to say
                return False
            written = apply(s, job, sid, records) if records else 0
            stop = wanted_stop(job.status, job.ray_submission_id, sid)
            current = job.status == S.RUNNING.value and job.ray_submission_id == sid
        if records:
            self.backend.ack(sid, written)
        if sid not in self._asked or self._asked[sid] != stop:
            self.backend.ask_stop(sid, stop)
            self._asked[sid] = stop
        return current

    def _follow_running(self) -> None:
        with session_scope(self.db_url) as s:
            jobs = list(
                s.execute(
                    select(Job.id, Job.ray_submission_id, Job.placement).where(
                        Job.status == S.RUNNING.value
                    )
                )
            )
        alive: list[set[str]] = []  # Ray's live nodes, asked once a pass if needed

        def lost_nodes(placement: dict[str, Any] | None) -> list[str]:
            placed = (placement or {}).get("nodes") or []
            if placed and not alive:
                alive.append({n.id for n in self.backend.nodes()})
            return sorted(set(placed) - alive[0]) if placed else []

        for job_id, sid, placement in jobs:
            if sid is None:
                continue
            with moved_on(job_id), self._job_alone(job_id):
                info = self.backend.run_status(sid)
                if info.status == SUCCEEDED:
                    self.relay(job_id, sid)  # its last words first
                    self._succeed(job_id)
                elif info.status in (FAILED, STOPPED):
                    self.relay(job_id, sid)  # the error it recorded, if any
                    self._run_failed(job_id, sid, ray_reason(info.message))
                elif lost := lost_nodes(placement):
                    # also a run Ray no longer knows whose nodes went with it (a restarted
                    # embedded Ray has new ones): placed again, not submitted there again
                    self._node_lost(job_id, sid, lost)
                elif info.status == NOT_FOUND:
                    log.warning("run %s of %s is unknown to Ray; submitting it", sid, job_id)
                    self._submit(job_id, sid)
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
        with self._writing() as s:
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

    @contextlib.contextmanager
    def _job_alone(self, job_id: str) -> Iterator[None]:
        """What goes wrong while following one job (Ray unreachable for it, its model's
        server not starting) is said on that job, once per distinct message, and the pass
        goes on with the others; the next pass tries the job again."""
        try:
            yield
        except (Conflict, LeaseLost):
            raise  # moved on by someone else, or no longer ours to follow: not trouble
        except Exception as exc:
            message = f"The controller could not follow this job this pass: {exc}"
            log.warning("job %s: %s", job_id, message)
            if self._trouble.get(job_id) != message:
                self._trouble[job_id] = message
                with self._writing() as s:
                    add_event(s, job_id, message[:2000], level="warn")

    def _fail_unreadable(self, job_id: str, status: JobStatus, exc: ValidationError) -> None:
        """Fail a job whose stored spec no longer validates (a value stored before a bound
        existed), naming what is wrong; the other jobs go on."""
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:5]
        )
        with moved_on(job_id), self._writing() as s:
            transition(
                s,
                job_id,
                status,
                S.FAILED,
                f"The job's settings are invalid: {problems}; create the job again with "
                "valid values",
                level="error",
                error={"code": "invalid_spec", "message": problems, "param": "tunefleet"},
            )

    def _run_failed(self, job_id: str, sid: str, message: str) -> None:
        """A run failed: retry it after a backoff, or fail the job with the error the run
        recorded (``scheduler.after_failure`` decides)."""
        with session_scope(self.db_url) as s:
            failures = s.scalar(select(Job.failures).where(Job.id == job_id)) or 0
            recorded = _recorded_error(s, job_id)
        retry = after_failure(failures, recorded.get("code") if recorded else None)
        if retry is not None:
            self._retry(job_id, sid, retry, message)
        else:
            self._fail(job_id, sid, message)

    def _submit_refused(self, job_id: str, sid: str, message: str) -> None:
        """Ray refused to take a run (its Jobs API says "no available agent" for a while
        after a node starts): retried as a failed run is, then the job fails with
        ``dispatch_failed``."""
        with session_scope(self.db_url) as s:
            failures = s.scalar(select(Job.failures).where(Job.id == job_id)) or 0
        retry = after_failure(failures)
        if retry is not None:
            self._retry(job_id, sid, retry, message)
            return
        with self._writing() as s:
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

    def _retry(self, job_id: str, sid: str, retry: Retry, message: str) -> None:
        """Requeue a job whose run failed, to start again after a backoff; the next run
        restores the newest checkpoint."""
        tail = self.backend.run_logs_tail(sid)
        log.warning(
            "run %s of job %s failed (%s); retrying in %ss (failure %d of %d)%s",
            sid, job_id, message or "no message", retry.delay_s, retry.failures,
            MAX_RUN_FAILURES, f"; its last log lines:\n{tail}" if tail else "",
        )  # fmt: skip
        with self._writing() as s:
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
        # The results file's object before the rows naming it: a crash between the two
        # leaves an object nothing names (the next pass writes another), never a row
        # naming nothing; the job succeeds with its File row in one transaction.
        step_metrics = self._write_results(job_id, tenant_id)
        try:
            with self._writing() as s:
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
        with self._writing() as s:
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

    def _stop_unwanted_runs(self) -> None:
        """Stop the Ray jobs of cancelled jobs now, and of paused jobs whose training loop
        did not checkpoint and leave by itself within ``PAUSE_GRACE_S``."""
        with session_scope(self.db_url) as s:
            rows = list(
                s.execute(
                    select(Job.id, Job.status, Job.updated_at, Job.ray_submission_id).where(
                        Job.status.in_([S.CANCELLED.value, S.PAUSED.value]),
                        Job.ray_submission_id.is_not(None),
                        # Runs stop within seconds; older rows were dealt with long ago.
                        Job.updated_at >= now_s() - 3600,
                    )
                )
            )
        for job_id, status, updated_at, sid in rows:
            if sid is None:
                continue
            if status == S.PAUSED.value and now_s() - updated_at < PAUSE_GRACE_S:
                continue
            if self.backend.run_status(sid).status not in TERMINAL_RAY | {NOT_FOUND}:
                self.backend.stop_run(sid)
                log.info("stopped run %s of %s job %s", sid, status, job_id)

    def run_in_process(self, job_id: str, sid: str) -> None:
        """One run of a job in this process, through the real driver, without the Jobs API
        (tests and benchmarks): its channel opened, what it reports written and its stops
        told every 0.2 s, and once more at its end. Raises what the run raised."""
        from tunefleet.workers.train.driver import run

        with session_scope(self.db_url) as s:
            job = s.get(Job, job_id)
            assert job is not None
            self.backend.open_channel(sid, run_inputs(job))
        ended = threading.Event()

        def relay() -> None:
            while not ended.wait(0.2):
                try:
                    self.relay(job_id, sid)
                except Exception:  # as a pass would: said, and tried again
                    log.exception("relaying run %s", sid)

        relaying = threading.Thread(target=relay, daemon=True, name=f"relay-{sid}")
        relaying.start()
        try:
            run(job_id, sid)
        finally:
            ended.set()
            relaying.join()
            self.relay(job_id, sid)
            self.backend.close_channel(sid)

    # -- serving ---------------------------------------------------------------------
    def ensure_served(self, base_model: str) -> bool:
        """Whether the Serve application of ``base_model`` is deployed (once per
        controller). A deploy runs on the serving thread, off the pass (it lasts as long as
        its first replica takes to load the model, or forever if the cluster cannot place
        one): the pass waits for it ``SERVE_WAIT_S`` at most and says False while it goes
        on. A failed deploy raises (naming why) until it is tried again after
        ``SERVE_RETRY_S``; one still going after ``SERVE_SLOW_S`` raises too, once."""
        if base_model in self._served:
            return True
        failed = self._serve_failed.get(base_model)
        if failed is not None and time.monotonic() < failed[0]:
            raise RuntimeError(failed[1])
        if base_model not in self._deploying:
            deploy = self._serving.submit(
                self.backend.deploy_model_server, base_model, str(self.registry.path(base_model))
            )
            self._deploying[base_model] = (time.monotonic(), deploy)
            futures.wait([deploy], timeout=self.SERVE_WAIT_S)
        started, deploy = self._deploying[base_model]
        if not deploy.done():
            if time.monotonic() - started > self.SERVE_SLOW_S:  # said once: one message
                raise RuntimeError(
                    f"serving base model {base_model!r} has been starting for more than "
                    f"{self.SERVE_SLOW_S:.0f}s; its replica may not fit the cluster (see Ray "
                    "Serve's status)"
                )
            return False
        del self._deploying[base_model]
        try:
            deploy.result()
        except Exception as exc:
            message = (
                f"serving base model {base_model!r} failed to start ({exc}); "
                f"retrying in {SERVE_RETRY_S}s"
            )
            self._serve_failed[base_model] = (time.monotonic() + SERVE_RETRY_S, message)
            raise RuntimeError(message) from exc
        self._serve_failed.pop(base_model, None)
        self._served.add(base_model)
        return True

    def _push_serving(self) -> None:
        """Push which adapters are served merged and which pinned (``serving_config``, as
        the admin API sets them) to every replica of each served base model: at once when
        it changed, and every ``serve_config_push_s`` anyway, so that a replica autoscaling
        started learns it. Replicas never read the database."""
        if not self._served or (self._pushing is not None and not self._pushing.done()):
            return
        with session_scope(self.db_url) as s:
            wanted = {base: serving_config(s, base) for base in sorted(self._served)}
        if wanted == self._pushed and time.monotonic() < self._next_push:
            return
        self._next_push = time.monotonic() + self.settings.serve_config_push_s
        self._pushing = self._push_pool.submit(self._push, wanted)

    def _push(self, wanted: dict[str, dict[str, list[str]]]) -> None:
        for base, config in wanted.items():
            try:
                self.backend.push_serving_config(base, config)
            except Exception as exc:  # the next push tries again
                log.warning("pushing the serving configuration of %s failed: %s", base, exc)
                self._pushed.pop(base, None)
            else:
                self._pushed[base] = config

    def _send_webhooks(self) -> None:
        """Hand the webhook outbox to the sending thread, unless its last send is still
        going (``_webhook_sender.send_due``)."""
        if self._sending is not None:
            if not self._sending.done():
                return
            if (exc := self._sending.exception()) is not None:
                log.error("sending webhooks failed: %s", exc)
        self._sending = self._webhook_pool.submit(
            send_due,
            lambda: session_scope(self.db_url),
            self._writing,
            self._http,
            delays=self.settings.webhook_retry_delays_s,
            timeout_s=self.settings.webhook_timeout_s,
        )

    def serve_existing_adapters(self) -> None:
        with session_scope(self.db_url) as s:
            bases = set(s.scalars(select(Adapter.base_model).distinct()))
        for base in sorted(bases):
            if base in self.registry.names():
                try:
                    self.ensure_served(base)
                except RuntimeError as exc:  # its jobs' adapters wait; other bases go on
                    log.warning("%s", exc)


def run_inputs(job: Job) -> dict[str, Any]:
    """What a run gets from its channel (it never reads the database): the spec as the API
    stored it, the device its plan is for (a micro-batch probe on CPU workers), and the
    node of each worker the scheduler placed it on."""
    return {
        "spec": job.spec,
        "device_memory_bytes": (job.plan or {}).get("device", {}).get("memory_bytes"),
        "nodes": (job.placement or {}).get("nodes"),
    }


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
    )
