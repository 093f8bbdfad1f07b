"""The controller: one loop that moves jobs through their life on Ray.

Each pass (``Controller.tick``) is a list of steps, each concern in a module of its own:

1. relay: write what runs reported through their channels (``workers/_run_channel.py``:
   runs never touch the database) and tell them whether to stop (here);
2. admission (``_admission.py``): count the files of new jobs, then queue them
   (``validating_files -> queued``);
3. following (``_following.py``): follow running jobs to their end (retrying failed runs
   with backoff);
4. dispatch (``_dispatch.py``): let the scheduling policy
   (``tunefleet.platform.scheduler.plan``) decide which queued jobs start and where, and
   apply those decisions;
5. capacity requests (``_capacity.py``): ask Ray's autoscaler for the nodes the jobs that
   wait for them need;
6. stop the Ray jobs of cancelled or paused ones (here);
7. serving (``_serving.py``): start serving the base of any adapter no run prepared (an
   imported one's); push which adapters are served how to the model servers;
8. webhooks (``_webhook_sender.py``): send the webhook outbox;
9. evals (``_evals.py``): start sampling and grading the eval runs that wait, each on a
   thread of its own, through the serving of step 7.

What the steps share (the fenced session, ``moved_on``, failpoints) is in ``_steps.py``.
Only the holder of the controller lease (``tunefleet.platform.lease``) runs passes; a
standby takes over when the leader stops renewing it.

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
import threading
import time
from collections.abc import Iterator
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from tunefleet.platform.artifacts import artifact_store
from tunefleet.platform.db import Job, now_s, session_scope
from tunefleet.platform.errors import Conflict
from tunefleet.platform.lease import Lease, LeaseLost
from tunefleet.platform.metrics import PASS_SECONDS
from tunefleet.platform.models import ModelRegistry
from tunefleet.platform.progress import apply, wanted_stop
from tunefleet.platform.settings import Settings
from tunefleet.platform.status import JobStatus, add_event
from tunefleet.workers._admission import Admission
from tunefleet.workers._capacity import CapacityRequests
from tunefleet.workers._dispatch import Dispatching, run_inputs
from tunefleet.workers._evals import EvalRuns
from tunefleet.workers._following import Following
from tunefleet.workers._serving import Serving
from tunefleet.workers._steps import PAUSE_GRACE_S, moved_on
from tunefleet.workers._webhook_sender import WebhookSender
from tunefleet.workers.backend import NOT_FOUND, TERMINAL_RAY, RayBackend

log = logging.getLogger(__name__)
S = JobStatus

# A run Ray does not know while its job has moved on keeps its channel this long: a submit
# that raised (the Jobs API's head timing out on its agent under load) may still have been
# taken, and the run, once it starts, must find its channel to learn that it is to stop.
UNKNOWN_RUN_GRACE_S = 60.0


class Controller:
    def __init__(self, settings: Settings, backend: RayBackend, *, lease: Lease | None = None):
        self.settings = settings
        self.backend = backend
        self.lease = lease
        self.db_url = settings.resolved_database_url
        self.store = artifact_store(settings)
        self.registry = ModelRegistry(settings.resolved_model_registry)
        self._trouble: dict[str, str] = {}  # job id -> the last trouble said on it
        self._asked: dict[str, dict[str, Any] | None] = {}  # run id -> the stop it was told
        self._unknown: dict[str, float] = {}  # run id -> when Ray first did not know it
        # the steps of a pass, each given what it needs (the fenced session: ``_writing``)
        self.admission = Admission(self.store, self.registry, self.db_url, self._writing)
        self.capacity = CapacityRequests(backend, settings.capacity_wait_s)
        self.serving = Serving(settings, backend, self.registry, self.db_url, self.store)
        self.dispatching = Dispatching(
            settings,
            backend,
            self.store,
            self.registry,
            self.capacity,
            self.db_url,
            self._writing,
            self._open_channel,
            self.serving.prepare,
        )
        self.following = Following(
            backend,
            self.store,
            self.db_url,
            self._writing,
            relay=self.relay,
            job_alone=self._job_alone,
            submit=self.dispatching.submit,
            ensure_served=self.serving.ensure_served,
            prefetch=self.serving.prefetch_before_success,
        )
        self.webhooks = WebhookSender(settings, self.db_url, self._writing)
        self.evals = EvalRuns(settings, self.db_url, self._writing, self.serving.ensure_served)
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
                            self.serving.serve_existing_adapters()
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
            self.admission.close()  # a count in progress stops at its next line
            self.serving.close()  # a deploy may never end: not waited for
            self.webhooks.close()
            self.evals.close()
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
        """One pass: the steps in order (see the module docstring)."""
        self._relay_runs()
        self.admission.admit()
        self.following.follow()
        waiting, running = self.dispatching.dispatch()
        self.capacity.ask(waiting, running)
        self._stop_unwanted_runs()
        self.serving.serve_new_bases()
        self.serving.push()
        self.webhooks.send()
        self.evals.run()

    # -- runs' channels --------------------------------------------------------------
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

    def _open_channel(self, sid: str, inputs: dict[str, Any]) -> None:
        """Open run ``sid``'s channel (dispatch, before its submit)."""
        self._asked.pop(sid, None)  # a channel opened again has been told nothing
        self.backend.open_channel(sid, inputs)

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

    def ensure_served(self, base_model: str) -> bool:
        """Whether the Serve application of ``base_model`` is deployed
        (``Serving.ensure_served``)."""
        return self.serving.ensure_served(base_model)
