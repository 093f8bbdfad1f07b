"""The controller: one loop that moves jobs through their life on Ray.

Each pass: admit jobs whose files are validated (``validating_files -> queued``), dispatch
queued jobs by priority then age while run slots are free (``queued -> running``, then a
Ray job), follow running jobs to their end, and stop the Ray jobs of cancelled ones. The
status moves through ``status.transition`` (compare-and-set), so an API cancel racing a
dispatch can never both win. The database write comes before the Ray submit, and the
submission id is deterministic, so a crash in between is repaired on the next pass.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from tunefleet.platform.artifacts import ArtifactStore
from tunefleet.platform.db import Adapter, Job, JobEvent, Tenant, now_s, session_scope
from tunefleet.platform.errors import Conflict
from tunefleet.platform.ids import new_id
from tunefleet.platform.models import ModelRegistry
from tunefleet.platform.settings import Settings
from tunefleet.platform.spec import JobSpec, fine_tuned_model_name
from tunefleet.platform.status import JobStatus, add_event, transition
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


# A paused run checkpoints and exits at its next step; past this it is stopped outright.
PAUSE_GRACE_S = 120


class Controller:
    def __init__(self, settings: Settings, backend: RayBackend, *, max_running: int = 1):
        self.settings = settings
        self.backend = backend
        self.max_running = max_running
        self.db_url = settings.resolved_database_url
        self.store = ArtifactStore(settings.resolved_artifact_root)
        self.registry = ModelRegistry(settings.resolved_model_registry)
        self._served: set[str] = set()
        self._tokenizers: dict[str, Any] = {}

    # -- the loop --------------------------------------------------------------------
    def run_forever(self, stop: threading.Event) -> None:
        self.serve_existing_adapters()
        while not stop.is_set():
            try:
                self.tick()
            except Exception:  # top of the loop: log, keep the controller alive
                log.exception("controller pass failed")
            stop.wait(self.settings.controller_interval_s)

    def tick(self) -> None:
        self._admit()
        self._follow_running()
        self._dispatch()
        self._stop_unwanted_runs()

    # -- steps -----------------------------------------------------------------------
    def _admit(self) -> None:
        """Count each new job's files in its base model's tokens, then queue it (or fail
        it with the reason when a file cannot be used)."""
        with session_scope(self.db_url) as s:
            pending = list(s.scalars(select(Job).where(Job.status == S.VALIDATING_FILES.value)))
            for job in pending:
                s.expunge(job)
        for job in pending:
            spec = JobSpec.model_validate(job.spec)
            try:
                stats = {
                    role: self._file_stats(file_id, job.model, spec.tunefleet.max_seq_len)
                    for role, file_id in (
                        ("training_file", job.training_file),
                        ("validation_file", job.validation_file),
                    )
                    if file_id
                }
                if stats["training_file"]["trained_tokens"] == 0:
                    raise ValueError(
                        "no example has tokens to learn from (assistant turns "
                        "with weight 1, completions or text)"
                    )
            except Exception as exc:  # any unreadable file fails this job, not the loop
                with moved_on(job.id), session_scope(self.db_url) as s:
                    transition(
                        s,
                        job.id,
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
            with moved_on(job.id), session_scope(self.db_url) as s:
                transition(
                    s,
                    job.id,
                    S.VALIDATING_FILES,
                    S.QUEUED,
                    f"Validated training file: {train['examples']} examples, "
                    f"{train['tokens']} tokens, {train['over_max_seq_len']} longer than "
                    f"{train['max_seq_len']} (truncated); job queued",
                    data=stats,
                    stats=stats,
                )

    def _file_stats(self, file_id: str, model: str, max_seq_len: int) -> dict[str, int]:
        from transformers import AutoTokenizer

        from tunefleet.workers.train.data import token_stats

        path = self.store.path(self.store.file_key(file_id))
        if not path.exists():
            raise FileNotFoundError(f"file {file_id} is no longer in the artifact store")
        if model not in self._tokenizers:
            self._tokenizers[model] = AutoTokenizer.from_pretrained(self.registry.require(model))
        return token_stats(path, self._tokenizers[model], max_seq_len)

    def _dispatch(self) -> None:
        """Start queued jobs by priority then age while run slots are free, never more
        than a tenant's ``max_concurrent_jobs`` at once; tell the others their place."""
        started: list[tuple[str, str]] = []
        with session_scope(self.db_url) as s:
            running = dict(
                s.execute(
                    select(Job.tenant_id, func.count())
                    .where(Job.status == S.RUNNING.value)
                    .group_by(Job.tenant_id)
                ).all()
            )
            limits = dict(s.execute(select(Tenant.id, Tenant.max_concurrent_jobs)).all())
            free = self.max_running - sum(running.values())
            queued = s.scalars(
                select(Job)
                .where(Job.status == S.QUEUED.value)
                .order_by(Job.priority.desc(), Job.created_ns, Job.id)
            )
            position = 0
            for job in queued:
                if free > 0 and running.get(job.tenant_id, 0) < limits.get(job.tenant_id, 0):
                    sid = f"{job.id}-{job.attempt + 1}"
                    with moved_on(job.id):
                        transition(
                            s,
                            job.id,
                            S.QUEUED,
                            S.RUNNING,
                            f"Dispatched as Ray job {sid}",
                            data={"ray_submission_id": sid, "attempt": job.attempt + 1},
                            attempt=job.attempt + 1,
                            ray_submission_id=sid,
                        )
                        started.append((job.id, sid))
                        free -= 1
                        running[job.tenant_id] = running.get(job.tenant_id, 0) + 1
                    continue
                position += 1
                self._note_queue_position(s, job.id, position)
        # Submit after the commit: a crash here leaves a running job whose Ray job is
        # NOT_FOUND, which _follow_running submits again under the same id.
        for job_id, sid in started:
            self._submit(job_id, sid)

    @staticmethod
    def _note_queue_position(s: Session, job_id: str, position: int) -> None:
        message = f"Waiting in queue at position {position}"
        last = s.scalar(
            select(JobEvent.message)
            .where(JobEvent.job_id == job_id)
            .order_by(JobEvent.seq.desc())
            .limit(1)
        )
        if last != message:
            add_event(s, job_id, message, data={"queue_position": position})

    def _submit(self, job_id: str, sid: str) -> None:
        env = {
            "TUNEFLEET_DATABASE_URL": self.db_url,
            "TUNEFLEET_ARTIFACT_ROOT": str(self.store.root),
            "TUNEFLEET_MODEL_REGISTRY": str(self.registry.root),
        }
        try:
            self.backend.submit_run(sid, job_id, env)
        except Exception as exc:
            with session_scope(self.db_url) as s:
                transition(
                    s,
                    job_id,
                    S.RUNNING,
                    S.FAILED,
                    f"Could not submit to Ray: {exc}",
                    level="error",
                    error={"code": "dispatch_failed", "message": str(exc)},
                )

    def _follow_running(self) -> None:
        with session_scope(self.db_url) as s:
            jobs = [
                (j.id, j.ray_submission_id)
                for j in s.scalars(select(Job).where(Job.status == S.RUNNING.value))
            ]
        for job_id, sid in jobs:
            if sid is None:
                continue
            info = self.backend.run_status(sid)
            with moved_on(job_id):
                if info.status == NOT_FOUND:
                    log.warning("run %s of %s is unknown to Ray; submitting it", sid, job_id)
                    self._submit(job_id, sid)
                elif info.status == SUCCEEDED:
                    self._succeed(job_id)
                elif info.status in (FAILED, STOPPED):
                    self._fail(job_id, sid, info.message)

    def _succeed(self, job_id: str) -> None:
        key = self.store.adapter_key(job_id)
        if not self.store.exists(key):
            self._fail(job_id, None, f"the run ended without an adapter at {key}")
            return
        with session_scope(self.db_url) as s:
            job = s.get(Job, job_id)
            assert job is not None
            base = job.model
        # Serving first: a job reads succeeded only once its model answers.
        self.ensure_served(base)
        with session_scope(self.db_url) as s:
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
                )
            )
            transition(
                s,
                job_id,
                S.RUNNING,
                S.SUCCEEDED,
                f"The job has successfully completed; fine-tuned model {name}",
                fine_tuned_model=name,
                estimated_finish=None,
                result_files=[],
            )

    def _fail(self, job_id: str, sid: str | None, message: str) -> None:
        with session_scope(self.db_url) as s:
            recorded = s.scalar(
                select(JobEvent.data)
                .where(JobEvent.job_id == job_id, JobEvent.level == "error")
                .order_by(JobEvent.seq.desc())
                .limit(1)
            )
            error: dict[str, Any]
            if recorded and "error" in recorded:
                error = dict(recorded["error"])
            else:
                tail = self.backend.run_logs_tail(sid) if sid else ""
                error = {"code": "training_failed", "message": (message + "\n" + tail).strip()}
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

    # -- serving ---------------------------------------------------------------------
    def ensure_served(self, base_model: str) -> None:
        """Deploy the Serve application of ``base_model`` once per controller."""
        if base_model in self._served:
            return
        self.backend.deploy_model_server(base_model, str(self.registry.path(base_model)))
        self._served.add(base_model)

    def serve_existing_adapters(self) -> None:
        with session_scope(self.db_url) as s:
            bases = set(s.scalars(select(Adapter.base_model).distinct()))
        for base in sorted(bases):
            if base in self.registry.names():
                self.ensure_served(base)
