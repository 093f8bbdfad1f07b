"""Serving, as the controller keeps it: each base model's Serve application deployed once
(``ensure_served``: a job reads succeeded only once its model answers), and which adapters
are served merged and which pinned pushed to every replica (``push``). Replicas never read
the database.

Both run off the pass, each on a thread of its own: a deploy lasts as long as its first
replica takes to load the model (or forever, if the cluster cannot place one), a push
merges adapters for seconds.
"""

from __future__ import annotations

import logging
import time
from concurrent import futures

from sqlalchemy import select

from tunefleet.platform.db import Adapter, session_scope
from tunefleet.platform.models import ModelRegistry
from tunefleet.platform.serving import serving_config
from tunefleet.platform.settings import Settings
from tunefleet.workers.backend import RayBackend

log = logging.getLogger(__name__)

# A base model whose Serve application failed to deploy is tried again after this long.
SERVE_RETRY_S = 60


class Serving:
    """The base models served, the deploys and the configuration pushes in flight."""

    # A pass waits this long for a Serve deploy; past SERVE_SLOW_S its jobs say so.
    SERVE_WAIT_S = 2.0
    SERVE_SLOW_S = 600.0

    def __init__(
        self, settings: Settings, backend: RayBackend, registry: ModelRegistry, db_url: str
    ):
        self.settings = settings
        self.backend = backend
        self.registry = registry
        self.db_url = db_url
        self._served: set[str] = set()
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

    def close(self) -> None:
        """Leave the threads without waiting: a deploy may never end."""
        self._serving.shutdown(wait=False, cancel_futures=True)
        self._push_pool.shutdown(wait=False, cancel_futures=True)

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
                self.backend.push_serving_config(base, config)
            except Exception as exc:  # the next push tries again
                log.warning("pushing the serving configuration of %s failed: %s", base, exc)
                self._pushed.pop(base, None)
            else:
                self._pushed[base] = config
