"""The job's integrations, written by the run's chief: Weights & Biases (OpenAI's
``wandb``) and MLflow (TuneFleet's). Each gets the job's config when the run starts,
every step's metrics as the platform records them, and the end.

A job has one tracker run per integration across all its runs: a resumed job (pause,
retry, fail-over) continues the same W&B run (its id is the job's) and the same MLflow run
(found by its ``tunefleet.job_id`` tag). Steps a resumed run trains again after its
checkpoint are logged again: W&B keeps the first, MLflow both.

An integration that fails (no credentials, a server away, a bad project) never fails the
job: it is dropped for the rest of the run, and ``warn`` says why once, which the loop
turns into a warning event on the job. What a tracking server answered is not in it (the
tenant may have pointed the integration at a server it should not read): an MLflow error
says its HTTP status and error code only; the run's log has the rest.

A tenant's MLflow ``tracking_uri`` is checked against the outbound policy (the API's
``TUNEFLEET_OUTBOUND_ALLOW``) when the run opens it, and every name lookup MLflow makes
for its host while the integration runs (in its thread: MLflow's client is synchronous)
is checked again (``outbound.guard_resolution``):
a host that resolves to a private or metadata address, then or later, is refused before
MLflow connects. The operator's default (``MLFLOW_TRACKING_URI``) is the operator's
choice and is not checked. W&B's server is the operator's (``WANDB_BASE_URL``): a tenant
names only a project, and an entity.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol
from urllib.parse import urlsplit

from tunefleet.platform.outbound import (
    PUBLIC_ONLY,
    OutboundPolicy,
    OutboundRefused,
    guard_resolution,
)
from tunefleet.platform.spec import Integration, JobSpec, MlflowOptions, WandbOptions

log = logging.getLogger(__name__)
JOB_TAG = "tunefleet.job_id"


class _Tracker(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def finish(self, completed: bool) -> None: ...


class _Wandb:
    def __init__(self, options: WandbOptions, spec: JobSpec, config: dict[str, Any]):
        import wandb

        self.run = wandb.init(
            project=options.project,
            entity=options.entity,
            name=options.name or spec.job_id,
            tags=list(options.tags),
            id=spec.job_id,
            resume="allow",
            config=config,
            settings=wandb.Settings(console="off", save_code=False, disable_git=True, silent=True),
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def finish(self, completed: bool) -> None:
        # a paused or stopped run ends its W&B run too: the next run of the job resumes it
        self.run.finish(exit_code=0 if completed else 1)


class _Mlflow:
    def __init__(self, options: MlflowOptions, spec: JobSpec, config: dict[str, Any]):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        # MLflow's client retries a server away for minutes by default, and each call here
        # holds up a training step: a few seconds, then the integration is dropped
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        self.client = client = MlflowClient(options.tracking_uri)
        experiment = client.get_experiment_by_name(options.experiment_name)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else client.create_experiment(options.experiment_name)
        )
        found = client.search_runs(
            [experiment_id], f"tags.`{JOB_TAG}` = '{spec.job_id}'", max_results=1
        )
        if found:
            self.run_id = found[0].info.run_id
            client.update_run(self.run_id, status="RUNNING")
        else:
            run = client.create_run(
                experiment_id,
                run_name=options.run_name or spec.job_id,
                tags={JOB_TAG: spec.job_id, "tunefleet.model": spec.model},
            )
            self.run_id = run.info.run_id
            # parameters are written once (MLflow refuses to change one)
            params = [Param(k, str(v)[:6000]) for k, v in config.items()]
            client.log_batch(self.run_id, params=params)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        at = int(time.time() * 1000)
        rows = [Metric(k, v, at, step) for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=rows)

    def finish(self, completed: bool) -> None:
        if completed:
            self.client.set_terminated(self.run_id, status="FINISHED")


def _open(integration: Integration, spec: JobSpec, config: dict[str, Any]) -> _Tracker:
    if integration.wandb is not None:
        return _Wandb(integration.wandb, spec, config)
    assert integration.mlflow is not None
    return _Mlflow(integration.mlflow, spec, config)


class Trackers:
    """The job's integrations for one run (the chief's; other workers make none)."""

    def __init__(
        self,
        spec: JobSpec,
        config: dict[str, Any],
        *,
        warn: Callable[[str], None],
        environment: dict[str, str] | None = None,
        outbound: OutboundPolicy = PUBLIC_ONLY,
    ):
        self._warn = warn
        self._outbound = outbound
        # the hosts of the tracking servers the tenant named, looked up only as allowed
        self._hosts = {
            urlsplit(i.mlflow.tracking_uri).hostname or "": "mlflow tracking_uri"
            for i in spec.integrations
            if i.mlflow is not None and i.mlflow.tracking_uri is not None
        }
        # by position in the job's list: a job may name two of one type (two MLflow
        # servers), each its own tracker
        self._open: dict[int, tuple[str, _Tracker]] = {}
        # where the integrations write, as the controller's environment says
        os.environ.update(environment or {})
        for i, integration in enumerate(spec.integrations):
            self._guard(i, integration.type, partial(self._start, i, integration, spec, config))

    def _start(
        self, i: int, integration: Integration, spec: JobSpec, config: dict[str, Any]
    ) -> None:
        if integration.mlflow is not None and integration.mlflow.tracking_uri is not None:
            self._outbound.check_url(integration.mlflow.tracking_uri, what="mlflow tracking_uri")
        self._open[i] = (integration.type, _open(integration, spec, config))

    def _guard(self, i: int, name: str, call: Callable[[], None]) -> None:
        """Run ``call`` for integration ``i`` (of type ``name``); if it raises, drop that
        integration and say so once. Broad on purpose: a tracker's library may raise
        anything, and no tracker may fail a job."""
        try:
            with guard_resolution(self._outbound, self._hosts):
                call()
        except Exception as exc:
            self._open.pop(i, None)
            log.warning("integration %s failed", name, exc_info=True)
            self._warn(
                f"The {name} integration failed and is off for the rest of this run "
                f"(training goes on): {_reason(exc)}"
            )

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        numbers = {
            k: float(v)
            for k, v in metrics.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
        }
        for i, (name, tracker) in list(self._open.items()):
            self._guard(i, name, partial(tracker.log, step, numbers))

    def finish(self, completed: bool) -> None:
        for i, (name, tracker) in list(self._open.items()):
            self._guard(i, name, partial(tracker.finish, completed))
        self._open.clear()


def _reason(exc: BaseException) -> str:
    """Why an integration failed, for the tenant: never what a server answered. An MLflow
    error (its message may quote the reply's body, or a refusal found inside MLflow's
    retries) gives its HTTP status and error code; others their own text (a local error,
    a connection refused, the outbound policy's refusal)."""
    refused = next((e for e in _chain(exc) if isinstance(e, OutboundRefused)), None)
    if refused is not None:
        return f"refused: {refused}"
    if type(exc).__module__.startswith("mlflow"):
        import requests  # MLflow's HTTP client

        unreachable = (ConnectionError, requests.exceptions.ConnectionError)
        unreached = next((e for e in _chain(exc) if isinstance(e, unreachable)), None)
        if unreached is not None:  # no answer: nothing of a server's to hide
            return (
                f"{type(exc).__name__}: could not connect to the tracking server "
                f"({type(unreached).__name__})"
            )
        status = getattr(exc, "get_http_status_code", lambda: None)()
        code = getattr(exc, "error_code", None)
        return (
            f"{type(exc).__name__} (HTTP {status}, {code}): the tracking server refused or "
            "failed the request; the run's log on its node has the details"
        )
    return f"{type(exc).__name__}: {str(exc)[:300]}"


def _chain(exc: BaseException | None) -> list[BaseException]:
    seen: list[BaseException] = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def job_config(spec: JobSpec, **extra: Any) -> dict[str, Any]:
    """What the trackers get as the run's config: the settled hyperparameters, the method
    and its options, the model, plus ``extra`` (what the run settled: micro-batch,
    strategy)."""
    opts = spec.tunefleet
    config: dict[str, Any] = {
        "job_id": spec.job_id,
        "model": spec.model,
        "training_file": spec.training_file,
        "validation_file": spec.validation_file,
        "n_epochs": spec.hyperparameters.n_epochs,
        "batch_size": spec.hyperparameters.batch_size,
        "learning_rate_multiplier": spec.hyperparameters.learning_rate_multiplier,
        "learning_rate": spec.learning_rate,
        "seed": spec.seed,
        "method": opts.method,
        "precision": opts.precision,
        "max_seq_len": opts.max_seq_len,
        "packing": opts.packing,
    }
    if opts.method in ("lora", "qlora"):
        config.update({f"lora_{k}": v for k, v in opts.lora.model_dump(mode="json").items()})
    return {**config, **extra}
