"""Serving, as the controller keeps it: each base model's Serve application deployed once
(``ensure_served``: a job reads succeeded only once its model answers), and which adapters
are served merged and which pinned pushed to every replica (``push``). Replicas never read
the database: a replica starting up reads the configuration last pushed from the artifact
store (``Keys.serving_key``), with the adapters most requested in the last hour (which
replicas count and report in their answers to a push), and loads those before it takes
traffic.

Both run off the pass, each on a thread of its own: a deploy lasts as long as its first
replica takes to load the model (or forever, if the cluster cannot place one), a push
merges adapters for seconds.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter, deque
from concurrent import futures
from typing import Any

from sqlalchemy import select

from tunefleet.platform.artifacts import S3Store, Store
from tunefleet.platform.db import Adapter, session_scope
from tunefleet.platform.models import ModelRegistry
from tunefleet.platform.serving import serving_config
from tunefleet.platform.settings import Settings
from tunefleet.workers.backend import RayBackend

log = logging.getLogger(__name__)

# A base model whose Serve application failed to deploy is tried again after this long.
SERVE_RETRY_S = 60

# A succeeded job's adapter is copied to its base model's serving nodes before the job
# reads succeeded, for at most this long; past it the job succeeds, and the replicas copy
# it with the next push (the newest adapters' prefetch).
PREFETCH_WAIT_S = 30.0

# A starting replica warms the adapters most requested over this long
# (``Settings.serve_warm_adapters`` of them).
WARM_WINDOW_S = 3600.0


class Serving:
    """The base models served, the deploys and the configuration pushes in flight."""

    # A pass waits this long for a Serve deploy; past SERVE_SLOW_S its jobs say so.
    SERVE_WAIT_S = 2.0
    SERVE_SLOW_S = 600.0
    NEW_BASES_S = 10.0

    def __init__(
        self,
        settings: Settings,
        backend: RayBackend,
        registry: ModelRegistry,
        db_url: str,
        store: Store,
    ):
        self.settings = settings
        self.store = store
        self.backend = backend
        self.registry = registry
        self.db_url = db_url
        self._served: set[str] = set()
        self._next_bases = 0.0  # when serve_new_bases looks again
        # base model -> (monotonic time of the next try, why the last one failed)
        self._serve_failed: dict[str, tuple[float, str]] = {}
        # base model -> its deploy on the serving thread
        self._serving = futures.ThreadPoolExecutor(1, thread_name_prefix="serving")
        self._deploying: dict[str, futures.Future[str]] = {}
        self._awaited: dict[str, float] = {}  # base model -> when a job first waited for it
        # base model -> the serving configuration its replicas last applied, and the push
        # in flight on its own thread (a merge takes seconds)
        self._pushed: dict[str, dict[str, list[str]]] = {}
        self._push_pool = futures.ThreadPoolExecutor(1, thread_name_prefix="serving-config")
        self._pushing: futures.Future[None] | None = None
        self._next_push = 0.0
        # base model -> requests per adapter its replicas reported, by monotonic time, over
        # the last WARM_WINDOW_S; and what its serving_key holds
        self._uses: dict[str, deque[tuple[float, Counter[str]]]] = {}
        self._written: dict[str, dict[str, list[str]]] = {}
        # job id -> (monotonic start, the copy of its adapter to every replica's node)
        self._prefetches: dict[str, tuple[float, futures.Future[list[Any]]]] = {}
        self._prefetch_pool = futures.ThreadPoolExecutor(2, thread_name_prefix="prefetch")

    def close(self) -> None:
        """Leave the threads without waiting: a deploy may never end."""
        self._serving.shutdown(wait=False, cancel_futures=True)
        self._push_pool.shutdown(wait=False, cancel_futures=True)
        self._prefetch_pool.shutdown(wait=False, cancel_futures=True)

    def prepare(self, base_model: str) -> None:
        """Start deploying ``base_model``'s Serve application, without waiting, unless it
        is served, deploying or waiting to be tried again. Called as a run of a job on it
        is submitted: the model loads while the job trains, and the job reads succeeded
        as its run ends instead of a model load later."""
        if base_model in self._served or base_model in self._deploying:
            return
        failed = self._serve_failed.get(base_model)
        if failed is not None and time.monotonic() < failed[0]:
            return
        deploy = self._serving.submit(
            self.backend.deploy_model_server, base_model, str(self.registry.path(base_model))
        )
        self._deploying[base_model] = deploy

    def ensure_served(self, base_model: str) -> bool:
        """Whether the Serve application of ``base_model`` is deployed (once per
        controller). A deploy runs on the serving thread, off the pass: the pass waits for
        it ``SERVE_WAIT_S`` at most and says False while it goes on. A failed deploy raises
        (naming why) until it is tried again after ``SERVE_RETRY_S``; one still going after
        ``SERVE_SLOW_S`` raises too, once."""
        if base_model in self._served:
            return True
        failed = self._serve_failed.get(base_model)
        if failed is not None and time.monotonic() < failed[0]:
            raise RuntimeError(failed[1])
        if base_model not in self._deploying:
            self.prepare(base_model)
            futures.wait([self._deploying[base_model]], timeout=self.SERVE_WAIT_S)
        # slow since a job first waited for it, not since ``prepare`` (hours of training)
        started = self._awaited.setdefault(base_model, time.monotonic())
        deploy = self._deploying[base_model]
        if not deploy.done():
            if time.monotonic() - started > self.SERVE_SLOW_S:  # said once: one message
                raise RuntimeError(
                    f"serving base model {base_model!r} has been starting for more than "
                    f"{self.SERVE_SLOW_S:.0f}s; its replica may not fit the cluster (see Ray "
                    "Serve's status)"
                )
            return False
        del self._deploying[base_model]
        self._awaited.pop(base_model, None)
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

    def prefetch_before_success(
        self, base_model: str, job_id: str
    ) -> tuple[str, dict[str, Any]] | None:
        """Copy a succeeded job's adapter from object storage to the node of every replica
        serving ``base_model``, off the pass: ``None`` while it copies (a later pass asks
        again), then what the job's events say of it (a message, and data: replicas that
        copied it, replicas), for at most PREFETCH_WAIT_S. With a local store, replicas
        read it in place: nothing to copy or say ("")."""
        if not isinstance(self.store, S3Store):
            return "", {}
        if job_id not in self._prefetches:
            copy = self._prefetch_pool.submit(
                self.backend.prefetch_adapter, base_model, job_id, PREFETCH_WAIT_S
            )
            self._prefetches[job_id] = (time.monotonic(), copy)
        started, copy = self._prefetches[job_id]
        if not copy.done() and time.monotonic() - started < PREFETCH_WAIT_S:
            return None
        del self._prefetches[job_id]
        later = (
            f"each replica copies it within {self.settings.serve_config_push_s:g}s of success "
            "(the newest adapters' prefetch); a request before then downloads it"
        )
        answers: list[Any] = []
        why = f"not done within {PREFETCH_WAIT_S:.0f}s"
        if copy.done():
            try:
                answers = copy.result()
                why = "no replica is running"
            except Exception as exc:
                why = str(exc)[:300]
        copied = [a for a in answers if isinstance(a, dict) and a.get("copied")]
        data = {"prefetched_replicas": len(copied), "serving_replicas": len(answers)}
        if answers and len(copied) == len(answers):
            return (
                f"The adapter was copied to the node cache of {len(copied)} replica(s) serving "
                f"{base_model} before the job succeeded: its first request loads from local "
                "disk",
                data,
            )
        if answers:
            failed = next(a for a in answers if a not in copied)
            why = failed.get("error", failed) if isinstance(failed, dict) else failed
        return (
            f"The adapter was copied to {len(copied)} of {len(answers)} replica(s) serving "
            f"{base_model} before the job succeeded ({why}); {later}",
            data,
        )

    def serve_existing_adapters(self) -> None:
        """Deploy the base model of every adapter on record (a controller taking the lead)."""
        with session_scope(self.db_url) as s:
            bases = set(s.scalars(select(Adapter.base_model).distinct()))
        for base in sorted(bases):
            if base in self.registry.names():
                try:
                    self.ensure_served(base)
                except RuntimeError as exc:  # its jobs' adapters wait; other bases go on
                    log.warning("%s", exc)

    def serve_new_bases(self) -> None:
        """Start serving, without waiting, the base model of any adapter on record that no
        run prepared (an imported adapter's, ``platform/adapter_import.py``): looked at
        every ``NEW_BASES_S``; a deploy goes on on the serving thread and is taken up by a
        later look."""
        if time.monotonic() < self._next_bases:
            return
        self._next_bases = time.monotonic() + self.NEW_BASES_S
        with session_scope(self.db_url) as s:
            bases = set(s.scalars(select(Adapter.base_model).distinct())) - self._served
        for base in sorted(bases & set(self.registry.names())):
            deploy = self._deploying.get(base)
            if deploy is None:
                self.prepare(base)
            elif deploy.done():
                try:
                    self.ensure_served(base)
                except RuntimeError as exc:  # said in the log; retried after SERVE_RETRY_S
                    log.warning("%s", exc)

    def push(self) -> None:
        """Push which adapters are served merged and which pinned (``serving_config``, as
        the admin API sets them) to every replica of each served base model: at once when
        it changed, and every ``serve_config_push_s`` anyway, so that a replica autoscaling
        started learns it."""
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
                answers = self.backend.push_serving_config(base, config)
            except Exception as exc:  # the next push tries again
                log.warning("pushing the serving configuration of %s failed: %s", base, exc)
                self._pushed.pop(base, None)
                continue
            self._pushed[base] = config
            self._count_uses(base, answers)
            try:
                self._write_for_new_replicas(base, config)
            except Exception as exc:  # storage away: the next push writes it
                log.warning("storing the serving configuration of %s failed: %s", base, exc)

    def _count_uses(self, base: str, answers: list[Any]) -> None:
        """Add the requests per adapter each replica counted since it last answered."""
        now = time.monotonic()
        window = self._uses.setdefault(base, deque())
        counted: Counter[str] = Counter()
        for answer in answers:
            if isinstance(answer, dict):
                counted.update({a: int(n) for a, n in (answer.get("uses") or {}).items()})
        if counted:
            window.append((now, counted))
        while window and window[0][0] < now - WARM_WINDOW_S:
            window.popleft()

    def warm(self, base: str) -> list[str]:
        """The adapters of ``base`` still on record most requested in the last hour, most
        first (ties by id), ``serve_warm_adapters`` at most."""
        total: Counter[str] = Counter()
        for _, counted in self._uses.get(base, ()):
            total.update(counted)
        if not total or self.settings.serve_warm_adapters == 0:
            return []
        with session_scope(self.db_url) as s:
            live = set(
                s.scalars(
                    select(Adapter.job_id).where(
                        Adapter.base_model == base, Adapter.job_id.in_(list(total))
                    )
                )
            )
        ranked = sorted((a for a in total if a in live), key=lambda a: (-total[a], a))
        return ranked[: self.settings.serve_warm_adapters]

    def _write_for_new_replicas(self, base: str, config: dict[str, list[str]]) -> None:
        """What a replica starting up applies before it takes traffic (``serving_key``),
        written when it changed."""
        stored = {**config, "warm": self.warm(base)}
        if self._written.get(base) != stored:
            self.store.write_bytes(self.store.serving_key(base), json.dumps(stored).encode())
            self._written[base] = stored
