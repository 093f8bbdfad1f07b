"""A job's integrations (``train/_trackers.py``) on the real libraries, offline: W&B in
offline mode writes its run files, MLflow a local SQLite store (MLflow's own choice: its
file store is in maintenance mode and refused unless MLFLOW_ALLOW_FILE_STORE is set).
One tracker run per job across its runs (a pause, a resume); a failing integration is
dropped with one warning, and the others go on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tracker_files import mlflow_run, wandb_config, wandb_history, wandb_records
from tunefleet.platform.spec import (
    Hyperparameters,
    Integration,
    JobSpec,
    MlflowOptions,
    TuneFleetOptions,
    WandbOptions,
)
from tunefleet.workers.train._trackers import Trackers, job_config


def _spec(*integrations: Integration, job_id: str = "ftjob-tracked1") -> JobSpec:
    return JobSpec(
        job_id=job_id,
        tenant_id="tenant-x",
        model="tiny-llama",
        training_file="file-1",
        hyperparameters=Hyperparameters(n_epochs=2, batch_size=4, learning_rate_multiplier=1),
        seed=3,
        tunefleet=TuneFleetOptions(),
        integrations=integrations,
    )


def test_wandb_offline_and_mlflow_hold_the_config_and_every_step_across_a_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    spec = _spec(
        Integration(type="wandb", wandb=WandbOptions(project="tunefleet-tests", tags=("ci",))),
        Integration(type="mlflow", mlflow=MlflowOptions(tracking_uri=uri, experiment_name="e")),
    )
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wandb")}
    for name in env:
        monkeypatch.delenv(name, raising=False)  # the run's environment says where
    warnings: list[str] = []
    config = job_config(spec, micro_batch=2)

    first = Trackers(spec, config, warn=warnings.append, environment=env)
    for step in (1, 2, 3):
        first.log(step, {"train_loss": 2.0 / step, "train_mean_token_accuracy": None, "epoch": 1})
    first.finish(completed=False)  # paused at step 3
    second = Trackers(spec, config, warn=warnings.append, environment=env)  # resumed
    second.log(4, {"train_loss": 0.4, "epoch": 2, "valid_loss": 0.5})
    second.finish(completed=True)
    assert warnings == []

    steps = wandb_history(tmp_path / "wandb")
    assert sorted(steps) == [1, 2, 3, 4]
    assert steps[2]["train_loss"] == pytest.approx(1.0)
    assert steps[4]["valid_loss"] == pytest.approx(0.5)
    assert "train_mean_token_accuracy" not in steps[1]  # None is not a number to log
    config = wandb_config(tmp_path / "wandb")
    assert config["learning_rate"] == spec.learning_rate and config["micro_batch"] == 2

    client, run = mlflow_run(uri, "e", spec.job_id)
    assert run.info.status == "FINISHED" and run.info.run_name == spec.job_id
    history = client.get_metric_history(run.info.run_id, "train_loss")
    assert [(m.step, round(m.value, 3)) for m in history] == [
        (1, 2.0),
        (2, 1.0),
        (3, 0.667),
        (4, 0.4),
    ]
    assert run.data.params["learning_rate"] == str(spec.learning_rate)
    assert run.data.params["micro_batch"] == "2"


STEPS = {1: 1.0, 2: 0.5, 3: 0.25}  # step -> train_loss


def _wandb_run(root: Path, job_id: str) -> Path:
    [folder] = root.rglob(f"offline-run-*-{job_id}")  # W&B's run id is the job's
    return folder


def _losses_in_wandb(root: Path, job_id: str) -> dict[int, float]:
    return {s: row["train_loss"] for s, row in wandb_history(_wandb_run(root, job_id)).items()}


def _wandb_exit_codes(root: Path, job_id: str) -> list[int]:
    """The exit codes the job's W&B run recorded (one per ``finish``)."""
    return [
        record.exit.exit_code
        for path in _wandb_run(root, job_id).rglob("run-*.wandb")
        for record in wandb_records(path)
        if record.WhichOneof("record_type") == "exit"
    ]


def _losses_in_mlflow(uri: str, job_id: str) -> tuple[dict[int, float], str]:
    client, run = mlflow_run(uri, "e", job_id)
    history = client.get_metric_history(run.info.run_id, "train_loss")
    return {m.step: m.value for m in history}, run.info.status


def test_a_failing_integration_is_dropped_with_one_warning_and_the_others_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job with W&B and MLflow: whichever fails (at the start or mid-run) is dropped
    with one warning naming it and why, and the other still gets every step and the end."""
    import wandb
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    for name in ("WANDB_MODE", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)  # the run's environment says where
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wandb")}
    wandb.teardown()  # W&B reads WANDB_DIR once per process: this test's, not an earlier's

    def train(spec: JobSpec, fail_after_1: Any = None) -> list[str]:
        """Log STEPS and finish; ``fail_after_1()`` runs after step 1 (a store turning
        unwritable). Returns the warnings."""
        warnings: list[str] = []
        trackers = Trackers(spec, job_config(spec), warn=warnings.append, environment=env)
        for step, loss in STEPS.items():
            trackers.log(step, {"train_loss": loss})
            if step == 1 and fail_after_1 is not None:
                fail_after_1()
        trackers.finish(completed=True)
        return warnings

    def refuse(*_: Any, **__: Any) -> None:
        raise OSError("No space left on device")

    def mlflow(uri: str) -> Integration:
        return Integration(
            type="mlflow", mlflow=MlflowOptions(tracking_uri=uri, experiment_name="e")
        )

    w_and_b = Integration(type="wandb", wandb=WandbOptions(project="tunefleet-tests"))

    # MLflow's server away from the start: W&B gets every step and the end
    spec = _spec(w_and_b, mlflow("http://127.0.0.1:9"), job_id="ftjob-mlflowaway")
    [said] = train(spec)
    assert said.startswith("The mlflow integration failed and is off for the rest of this run")
    assert "127.0.0.1:9" in said
    assert _losses_in_wandb(tmp_path, spec.job_id) == STEPS
    assert _wandb_exit_codes(tmp_path, spec.job_id) == [0]

    # MLflow's store refuses writes after step 1: W&B gets every step and the end
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    spec = _spec(mlflow(uri), w_and_b, job_id="ftjob-mlflowfull")
    with monkeypatch.context() as m:
        [said] = train(spec, lambda: m.setattr(MlflowClient, "log_batch", refuse))
    assert said.startswith("The mlflow integration failed") and "No space left on device" in said
    assert _losses_in_wandb(tmp_path, spec.job_id) == STEPS
    assert _wandb_exit_codes(tmp_path, spec.job_id) == [0]
    assert _losses_in_mlflow(uri, spec.job_id) == ({1: 1.0}, "RUNNING")  # before it failed

    # W&B fails after step 1: MLflow gets every step and the end
    spec = _spec(w_and_b, mlflow(uri), job_id="ftjob-wandbfull")
    with monkeypatch.context() as m:
        [said] = train(spec, lambda: m.setattr(wandb.sdk.wandb_run.Run, "log", refuse))
    wandb.finish()  # the run W&B was dropped from is still open in this process
    assert said.startswith("The wandb integration failed") and "No space left on device" in said
    assert _losses_in_mlflow(uri, spec.job_id) == (STEPS, "FINISHED")
    assert _losses_in_wandb(tmp_path, spec.job_id) == {1: 1.0}


def test_two_integrations_of_one_type_each_get_every_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    spec = _spec(
        Integration(type="mlflow", mlflow=MlflowOptions(tracking_uri=uri, experiment_name="e")),
        Integration(type="mlflow", mlflow=MlflowOptions(tracking_uri="http://127.0.0.1:9")),
    )
    warnings: list[str] = []
    trackers = Trackers(spec, job_config(spec), warn=warnings.append)
    for step, loss in STEPS.items():
        trackers.log(step, {"train_loss": loss})
    trackers.finish(completed=True)
    assert len(warnings) == 1 and "127.0.0.1:9" in warnings[0]
    assert _losses_in_mlflow(uri, spec.job_id) == (STEPS, "FINISHED")
