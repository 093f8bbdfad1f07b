"""A job's integrations (``train/_trackers.py``) on the real libraries, offline: W&B in
offline mode writes its run files, MLflow a local SQLite store (MLflow's own choice: its
file store is in maintenance mode and refused unless MLFLOW_ALLOW_FILE_STORE is set).
One tracker run per job across its runs (a pause, a resume); a failing integration is
dropped with one warning, and the others go on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tracker_files import mlflow_run, wandb_config, wandb_history
from tunefleet.platform.spec import (
    Hyperparameters,
    Integration,
    JobSpec,
    MlflowOptions,
    TuneFleetOptions,
    WandbOptions,
)
from tunefleet.workers.train._trackers import Trackers, job_config


def _spec(*integrations: Integration) -> JobSpec:
    return JobSpec(
        job_id="ftjob-tracked1",
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


def test_a_failing_integration_is_dropped_with_one_warning_and_the_others_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    spec = _spec(
        Integration(
            type="mlflow",
            mlflow=MlflowOptions(tracking_uri="http://127.0.0.1:9", experiment_name="x"),
        ),
    )
    warnings: list[str] = []
    trackers = Trackers(spec, job_config(spec), warn=warnings.append)
    trackers.log(1, {"train_loss": 1.0})
    trackers.finish(completed=True)
    [said] = warnings
    assert said.startswith("The mlflow integration failed and is off for the rest of this run")
    assert "127.0.0.1:9" in said

    # one that fails mid-run: its store becomes unwritable after the first step
    spec = _spec(Integration(type="mlflow", mlflow=MlflowOptions(tracking_uri=uri)))
    warnings.clear()
    trackers = Trackers(spec, job_config(spec), warn=warnings.append)
    trackers.log(1, {"train_loss": 1.0})

    def refuse(*_: Any, **__: Any) -> None:
        raise OSError("No space left on device")

    from mlflow.tracking import MlflowClient

    monkeypatch.setattr(MlflowClient, "log_batch", refuse)
    trackers.log(2, {"train_loss": 0.5})
    trackers.log(3, {"train_loss": 0.2})
    trackers.finish(completed=True)
    assert len(warnings) == 1 and "No space left on device" in warnings[0]
