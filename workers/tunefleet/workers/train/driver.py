"""Entry point of one run: ``python -m tunefleet.workers.train.driver JOB_ID``.

Runs as a Ray job. Reads the job's spec from the database exactly as the API stored it,
builds a Ray Train ``TorchTrainer`` from it, and on success copies the final adapter into
the artifact store. Any failure is recorded on the job as an error event before the
process exits non-zero; the controller turns that into the job's ``error``.
"""

from __future__ import annotations

import logging
import sys
import traceback
from pathlib import Path

from tunefleet.platform.artifacts import ArtifactStore
from tunefleet.platform.db import Job, session_scope
from tunefleet.platform.models import ModelRegistry
from tunefleet.platform.settings import get_settings
from tunefleet.platform.spec import JobSpec
from tunefleet.platform.status import add_event

log = logging.getLogger("tunefleet.driver")


def run(job_id: str) -> None:
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from tunefleet.workers.train.checkpoint import ADAPTER_DIR
    from tunefleet.workers.train.loop import train_loop_per_worker

    settings = get_settings()
    db_url = settings.resolved_database_url
    store = ArtifactStore(settings.resolved_artifact_root)
    with session_scope(db_url) as s:
        job = s.get(Job, job_id)
        if job is None:
            raise SystemExit(f"job {job_id} is not in the database at {db_url}")
        spec = JobSpec.model_validate(job.spec)
        # the device the plan (and a micro-batch probe on CPU workers) is for
        device_bytes = (job.plan or {}).get("device", {}).get("memory_bytes")
    registry = ModelRegistry(settings.resolved_model_registry)
    res = spec.tunefleet.resources
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "spec": spec.model_dump(mode="json"),
            "database_url": db_url,
            "model_path": str(registry.require(spec.model)),
            "train_path": str(store.path(store.file_key(spec.training_file))),
            "validation_path": str(store.path(store.file_key(spec.validation_file)))
            if spec.validation_file
            else None,
            "checkpoints_key": store.checkpoints_key(job_id),
            "device_memory_bytes": device_bytes,
        },
        scaling_config=ScalingConfig(
            num_workers=res.num_workers,
            use_gpu=res.gpus_per_worker > 0,
            resources_per_worker={"CPU": res.cpus_per_worker, "GPU": res.gpus_per_worker},
        ),
        # Same name and storage on every run of a job: Ray Train restores the newest
        # checkpoint by itself, which is how pause/resume and retries continue.
        run_config=RunConfig(
            name=job_id,
            storage_path=str(store.path(store.checkpoints_key(job_id)).parent),
            checkpoint_config=CheckpointConfig(num_to_keep=3),
            failure_config=FailureConfig(max_failures=2),
        ),
    )
    result = trainer.fit()
    if not result.metrics or not result.metrics.get("final"):
        log.info("run of %s stopped early on request (%s)", job_id, result.metrics)
        return
    if result.checkpoint is None:
        raise RuntimeError("training finished without a final checkpoint")
    with result.checkpoint.as_directory() as folder:
        store.put_dir(store.adapter_key(job_id), Path(folder) / ADAPTER_DIR)
    log.info("adapter for %s stored at %s", job_id, store.adapter_key(job_id))
    if spec.tunefleet.merged_model:
        store_merged(spec, str(registry.require(spec.model)), store)


def store_merged(spec: JobSpec, model_path: str, store: ArtifactStore) -> None:
    """The merged model (``TuneFleetOptions.merged_model``) with the base's tokenizer, as
    safetensors, under ``merged/{job}``; an event says where."""
    import tempfile

    from transformers import AutoTokenizer

    from tunefleet.workers.train.methods import merged_model

    key = store.merged_key(spec.job_id)
    model = merged_model(spec, model_path, store.path(store.adapter_key(spec.job_id)))
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(model_path).save_pretrained(tmp)
        store.put_dir(key, Path(tmp))
    with session_scope(get_settings().resolved_database_url) as s:
        add_event(s, spec.job_id, f"Merged model stored at {key}", data={"merged_model": key})


def main() -> None:
    logging.basicConfig(level=logging.INFO)
    job_id = sys.argv[1]
    try:
        run(job_id)
    except BaseException as exc:  # top of the process: record the failure on the job
        detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        with session_scope(get_settings().resolved_database_url) as s:
            add_event(
                s,
                job_id,
                f"Training failed: {detail}",
                level="error",
                data={"error": {"code": "training_failed", "message": detail}},
            )
        traceback.print_exc()
        raise SystemExit(1) from exc


if __name__ == "__main__":
    main()
