"""Entry point of one run: ``python -m tunefleet.workers.train.driver JOB_ID``.

Runs as a Ray job, with no access to the database: the run's channel
(``workers/_run_channel.py``, opened by the controller) hands it the job's spec exactly as
the API stored it, and carries what it has to say back. It builds a Ray Train
``TorchTrainer`` from the spec, and on success copies the final adapter into the artifact
store. Any failure is reported as an error event before the process exits non-zero; the
controller turns that into the job's ``error``.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from tunefleet.platform.artifacts import Store, artifact_store
from tunefleet.platform.model_cache import local_model
from tunefleet.platform.models import ModelRegistry
from tunefleet.platform.settings import get_settings
from tunefleet.platform.spec import INTEGRATION_ENV, JobSpec
from tunefleet.workers._run_channel import CLUSTER_ENV, ChannelReporter, run_inputs

log = logging.getLogger("tunefleet.driver")


# Ray Train settings a run starts with unless the cluster's environment says otherwise:
# the controller notices the end of a run (and a dead worker) within half a second, not
# two; no preemption-watcher actor (one more Python process on the run's critical path;
# a preempted run is retried from its checkpoint like any failed one).
RAY_TRAIN_DEFAULTS = {
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
}


# Ray Train callbacks a TuneFleet run has no use for, each an actor (a Python process that
# imports Ray Train) started on the run's critical path: the Ray Data manager (runs read
# their files themselves, no Ray Dataset) and the placement-group cleaner (a run is a Ray
# job, and Ray removes a job's placement groups when it ends). Matched by name: a Ray that
# renames them keeps them, which costs time, not correctness.
UNUSED_RAY_TRAIN_CALLBACKS = {"DatasetsCallback", "PlacementGroupCleanerCallback"}


def _trainer_class() -> Any:
    """Ray Train's ``TorchTrainer`` without ``UNUSED_RAY_TRAIN_CALLBACKS``, whose run asks
    Ray's autoscaler for nothing.

    The controller's request (``workers/_capacity.py``) already holds the run's workers. Ray
    Train's own (its scaling policy's, sent through Ray's "AutoscalingCoordinator" actor,
    again every 20 s) replaced it: ``request_resources`` keeps one request per cluster,
    the last sent. Seen in the elastic test: a second job's new node was taken back as
    idle while its run started, because the first run's request, sent later, held only
    the first run's workers."""
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.execution.scaling_policy import FixedScalingPolicy

    class ControllerAskedScaling(FixedScalingPolicy):
        def _send_resource_request(self) -> None:
            pass

        def _maybe_send_resource_request(self) -> None:
            pass

        def _cancel_resource_request(self) -> None:
            pass

    class LeanTorchTrainer(TorchTrainer):
        def _create_default_callbacks(self) -> list[Any]:
            callbacks: list[Any] = super()._create_default_callbacks()  # type: ignore[misc]
            return [c for c in callbacks if type(c).__name__ not in UNUSED_RAY_TRAIN_CALLBACKS]

        def _initialize_and_run_controller(self, **kwargs: Any) -> Any:
            policy = kwargs.get("scaling_policy")
            if type(policy) is FixedScalingPolicy:
                kwargs["scaling_policy"] = ControllerAskedScaling(policy.scaling_config)
            return super()._initialize_and_run_controller(**kwargs)  # type: ignore[misc]

    return LeanTorchTrainer


def train_fn(config: dict[str, Any]) -> None:
    """What each Ray Train worker runs: the loop, imported there, so that the driver does
    not import what only the workers need (transformers, peft, the loop's modules)."""
    from tunefleet.workers.train._loop import train_loop_per_worker

    train_loop_per_worker(config)


def placement(
    nodes: list[str] | None, workers: int, alive: set[str]
) -> list[dict[str, str]] | None:
    """Each worker on the node the scheduler placed it on (Ray's built-in node-id label), so
    that the capacity the controller counted as taken is the capacity used; None (Ray
    places them) for a run started without a placement, or placed on a node that is gone
    (a run submitted again after Ray restarted)."""
    if not nodes or len(nodes) != workers or not set(nodes) <= alive:
        return None
    return [{NODE_ID_LABEL: node} for node in nodes]


def _alive_nodes() -> set[str]:
    import ray

    return {str(n["NodeID"]) for n in ray.nodes() if n.get("Alive")}


# The label every Ray node carries with its node id (ray.util.placement_group's
# NODE_ID_LABEL_KEY).
NODE_ID_LABEL = "ray.io/node-id"


class RunFailed(RuntimeError):
    """The training loop left on a failure it has already recorded on the job (with its
    own error code), e.g. a full disk at a checkpoint."""


def run(job_id: str, run_id: str) -> None:
    """Run the job's training; ``run_id`` is the Ray job id the controller submitted this
    run under (``TUNEFLEET_RUN_ID``) and opened its channel for."""
    import psutil
    import ray

    for name, value in RAY_TRAIN_DEFAULTS.items():
        os.environ.setdefault(name, value)  # read and passed on by TorchTrainer
    # Ray Train v2 (the default in this Ray), named so: its ScalingConfig places workers by
    # label
    from ray.train.v2.api.config import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig

    settings = get_settings()
    store = artifact_store(settings)
    if not ray.is_initialized():
        # the cluster the controller submitted this run to (run_channel.CLUSTER_ENV)
        ray.init(address=os.environ.get(CLUSTER_ENV))
    inputs = run_inputs(run_id)
    spec = JobSpec.model_validate(inputs["spec"])
    # the device the plan (and a micro-batch probe on CPU workers) is for
    device_bytes = inputs.get("device_memory_bytes")
    registry = ModelRegistry(settings.resolved_model_registry)
    res = spec.tunefleet.resources
    # checkpoints/{job}/step-N in the artifact store, local or object storage alike
    storage_path, storage_filesystem = store.ray_storage(store.CHECKPOINTS)
    trainer = _trainer_class()(
        train_fn,
        train_loop_config={
            "spec": spec.model_dump(mode="json"),
            "model_path": str(registry.require(spec.model)),
            # keys: each worker reads its node's copy (artifacts may be in object storage)
            "store": {
                "location": store.location,
                "endpoint_url": settings.s3_endpoint_url,
                "region": settings.s3_region,
            },
            "train_key": store.file_key(spec.training_file),
            "validation_key": store.file_key(spec.validation_file)
            if spec.validation_file
            else None,
            "checkpoints_key": store.checkpoints_key(job_id),
            # the weights a job starts from (tunefleet.init_from_job): that job's adapter
            "init_key": store.adapter_key(spec.tunefleet.init_from_job)
            if spec.tunefleet.init_from_job
            else None,
            "device_memory_bytes": device_bytes,
            # which run of the job this is: a run that is no longer the job's current one
            # (a pause and resume it did not see) checkpoints and leaves
            "run_id": run_id,
            # where the job's integrations write (never their credentials: see
            # spec.INTEGRATION_ENV)
            "integration_env": {k: os.environ[k] for k in INTEGRATION_ENV if k in os.environ},
            # where the integrations a tenant addressed may connect (the API's policy)
            "outbound_allow": list(settings.outbound_allow),
            # where a run's start-up time goes (the loop reports it with its first event)
            "startup": {
                "driver_process": psutil.Process().create_time(),
                "trainer_fit": time.time(),
            },
        },
        scaling_config=ScalingConfig(
            num_workers=res.num_workers,
            use_gpu=res.gpus_per_worker > 0,
            resources_per_worker={
                "CPU": res.cpus_per_worker,
                "GPU": res.gpus_per_worker,
                **res.custom_resources_per_worker,
            },
            label_selector=placement(inputs.get("nodes"), res.num_workers, _alive_nodes()),
        ),
        # Same name and storage on every run of a job: Ray Train restores the newest
        # checkpoint by itself, which is how pause/resume and retries continue.
        run_config=RunConfig(
            name=job_id,
            storage_path=storage_path,
            storage_filesystem=storage_filesystem,
            checkpoint_config=CheckpointConfig(num_to_keep=3),
            # finite everywhere: a run that cannot go on fails, and the controller retries
            # the job from its newest checkpoint with a new placement
            failure_config=FailureConfig(
                max_failures=2, controller_failure_limit=2, max_preemption_failures=2
            ),
        ),
    )
    result = trainer.fit()
    if failed := (result.metrics or {}).get("failed"):
        raise RunFailed(failed["message"])  # the loop recorded it on the job
    if not result.metrics or not result.metrics.get("final"):
        log.info("run of %s stopped early on request (%s)", job_id, result.metrics)
        return
    if result.checkpoint is None:
        raise RuntimeError("training finished without a final checkpoint")
    from tunefleet.workers.train._checkpoint import ADAPTER_DIR

    with result.checkpoint.as_directory() as folder:
        store.put_dir(store.adapter_key(job_id), Path(folder) / ADAPTER_DIR)
    log.info("adapter for %s stored at %s", job_id, store.adapter_key(job_id))
    if spec.tunefleet.merged_model:
        store_merged(spec, str(registry.require(spec.model)), store, ChannelReporter(run_id))


def store_merged(spec: JobSpec, model_path: str, store: Store, reporter: ChannelReporter) -> None:
    """The merged model (``TuneFleetOptions.merged_model``) with the base's tokenizer, as
    safetensors, under ``merged/{job}``; an event says where."""
    import tempfile

    from transformers import AutoTokenizer

    from tunefleet.workers.train._methods import merged_model

    key = store.merged_key(spec.job_id)
    with (
        store.pinned_copy(store.adapter_key(spec.job_id)) as adapter,  # kept while read
        local_model(model_path, get_settings()) as base,  # this node's copy, if cached
    ):
        model = merged_model(spec, str(base), adapter)
        tokenizer = AutoTokenizer.from_pretrained(base)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        store.put_dir(key, Path(tmp))
    reporter.post("message", message=f"Merged model stored at {key}", data={"merged_model": key})


def main() -> None:
    logging.basicConfig(level=logging.INFO)
    job_id = sys.argv[1]
    run_id = os.environ["TUNEFLEET_RUN_ID"]
    try:
        run(job_id, run_id)
    except RunFailed as exc:
        log.error("run of %s failed: %s", job_id, exc)
        raise SystemExit(1) from exc
    except BaseException as exc:  # top of the process: record the failure on the job
        detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        traceback.print_exc()
        try:
            ChannelReporter(run_id).post(
                "message",
                message=f"Training failed: {detail}",
                level="error",
                data={"error": {"code": "training_failed", "message": detail}},
            )
        except Exception as lost:  # no channel to say it through: the log's last lines do
            print(f"run {run_id} could not report its failure ({lost}); it failed: {detail}",
                  flush=True)  # fmt: skip
        raise SystemExit(1) from exc


if __name__ == "__main__":
    main()
