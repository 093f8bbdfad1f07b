"""The controller: one loop that moves jobs through their life on Ray.

Each pass: admit jobs whose files are validated (``validating_files -> queued``), dispatch
queued jobs by priority then age while run slots are free (``queued -> running``, then a
Ray job), follow running jobs to their end, and stop the Ray jobs of cancelled ones. The
status moves through ``status.transition`` (compare-and-set), so an API cancel racing a
dispatch can never both win. The database write comes before the Ray submit, and the
submission id is deterministic, so a crash in between is repaired on the next pass.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from sqlalchemy import func, select

from tunefleet.platform.artifacts import ArtifactStore
from tunefleet.platform.db import Adapter, File, Job, JobEvent, Tenant, now_s, session_scope
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


class Controller:
    def __init__(self, settings: Settings, backend: RayBackend, *, max_running: int = 1):
        self.settings = settings
        self.backend = backend
        self.max_running = max_running
        self.db_url = settings.resolved_database_url
        self.store = ArtifactStore(settings.resolved_artifact_root)
        self.registry = ModelRegistry(settings.resolved_model_registry)
        self._served: set[str] = set()

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
        self._stop_cancelled()

    # -- steps -----------------------------------------------------------------------
    def _admit(self) -> None:
        with session_scope(self.db_url) as s:
            for job in s.scalars(select(Job).where(Job.status == S.VALIDATING_FILES.value)):
                files = [job.training_file] + ([job.validation_file] if job.validation_file else [])
                rows = [s.get(File, f) for f in files]
                bad = [
                    f
                    for f, row in zip(files, rows, strict=True)
                    if row is None or row.status != "processed"
                ]
                if bad:
                    transition(
                        s,
                        job.id,
                        S.VALIDATING_FILES,
                        S.FAILED,
                        f"File validation failed: {', '.join(bad)} not usable",
                        level="error",
                        error={
                            "code": "invalid_file",
                            "message": f"files not usable: {bad}",
                            "param": "training_file",
                        },
                    )
                    continue
                examples = rows[0].stats.get("examples") if rows[0] else None
                transition(
                    s,
                    job.id,
                    S.VALIDATING_FILES,
                    S.QUEUED,
                    f"Validated training file: {examples} examples; job queued",
                )

    def _dispatch(self) -> None:
        with session_scope(self.db_url) as s:
            n_running = (
                s.scalar(select(func.count()).select_from(Job).where(Job.status == S.RUNNING.value))
                or 0
            )
            queued = list(
                s.scalars(
                    select(Job)
                    .where(Job.status == S.QUEUED.value)
                    .order_by(Job.priority.desc(), Job.created_at, Job.id)
                )
            )
            free = self.max_running - n_running
            to_start = queued[: max(free, 0)]
            for position, job in enumerate(queued[len(to_start) :], start=1):
                last = s.scalar(
                    select(JobEvent.message)
                    .where(JobEvent.job_id == job.id)
                    .order_by(JobEvent.seq.desc())
                    .limit(1)
                )
                message = f"Waiting in queue at position {position}"
                if last != message:
                    add_event(s, job.id, message, data={"queue_position": position})
            for job in to_start:
                attempt = job.attempt + 1
                sid = f"{job.id}-{attempt}"
                transition(
                    s,
                    job.id,
                    S.QUEUED,
                    S.RUNNING,
                    f"Dispatched as Ray job {sid}",
                    data={"ray_submission_id": sid, "attempt": attempt},
                    attempt=attempt,
                    ray_submission_id=sid,
                )
        # Submit after the commit: a crash here leaves a running job whose Ray job is
        # NOT_FOUND, which _follow_running submits again under the same id.
        for job in to_start:
            self._submit(job.id, f"{job.id}-{job.attempt + 1}")

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

    def _stop_cancelled(self) -> None:
        with session_scope(self.db_url) as s:
            rows = list(
                s.execute(
                    select(Job.id, Job.ray_submission_id).where(
                        Job.status.in_([S.CANCELLED.value, S.PAUSED.value]),
                        Job.ray_submission_id.is_not(None),
                        # Runs stop within seconds; older rows were dealt with long ago.
                        Job.updated_at >= now_s() - 3600,
                    )
                )
            )
        for job_id, sid in rows:
            assert sid is not None  # filtered in the query
            if self.backend.run_status(sid).status not in TERMINAL_RAY | {NOT_FOUND}:
                self.backend.stop_run(sid)
                log.info("stopped run %s of %s", sid, job_id)

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
