"""A job's integrations (``train/_trackers.py``) on the real libraries, offline: W&B in
offline mode writes its run files, MLflow a local SQLite store (MLflow's own choice: its
file store is in maintenance mode and refused unless MLFLOW_ALLOW_FILE_STORE is set).
One tracker run per job across its runs (a pause, a resume); a failing integration is
dropped with one warning, and the others go on."""

from __future__ import annotations

import http.server
import socket
import threading
from pathlib import Path
from typing import Any

import pytest

from tracker_files import mlflow_run, wandb_config, wandb_history, wandb_records
from tunefleet.platform import outbound
from tunefleet.platform.outbound import OutboundPolicy
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
        Integration(type="mlflow", mlflow=MlflowOptions(experiment_name="e")),
    )
    # the run's environment says where: the operator's MLflow store, W&B offline
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wandb"), **operator_mlflow(uri)}
    for name in env:
        _unset_after(monkeypatch, name)
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
# a tracking server on this machine, allowed as an operator allows an internal one
LOCAL = OutboundPolicy.from_allow(["127.0.0.1/32"])


def operator_mlflow(uri: str) -> dict[str, str]:
    """The operator's MLflow store, as the controller's environment hands it to runs:
    a tenant may name only http(s) servers, never a local store."""
    return {"MLFLOW_TRACKING_URI": uri}


def _unset_after(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """``name`` gone now and after the test (Trackers sets the run's environment in this
    process)."""
    monkeypatch.setenv(name, "")
    monkeypatch.delenv(name)


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
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wandb"), **operator_mlflow(uri)}
    for name in env:
        _unset_after(monkeypatch, name)  # the run's environment says where
    wandb.teardown()  # W&B reads WANDB_DIR once per process: this test's, not an earlier's

    def train(spec: JobSpec, fail_after_1: Any = None) -> list[str]:
        """Log STEPS and finish; ``fail_after_1()`` runs after step 1 (a store turning
        unwritable). Returns the warnings."""
        warnings: list[str] = []
        trackers = Trackers(
            spec, job_config(spec), warn=warnings.append, environment=env, outbound=LOCAL
        )
        for step, loss in STEPS.items():
            trackers.log(step, {"train_loss": loss})
            if step == 1 and fail_after_1 is not None:
                fail_after_1()
        trackers.finish(completed=True)
        return warnings

    def refuse(*_: Any, **__: Any) -> None:
        raise OSError("No space left on device")

    def mlflow(uri: str | None = None) -> Integration:
        return Integration(
            type="mlflow", mlflow=MlflowOptions(tracking_uri=uri, experiment_name="e")
        )

    w_and_b = Integration(type="wandb", wandb=WandbOptions(project="tunefleet-tests"))

    # MLflow's server away from the start: W&B gets every step and the end
    spec = _spec(w_and_b, mlflow("http://127.0.0.1:9"), job_id="ftjob-mlflowaway")
    [said] = train(spec)
    assert said.startswith("The mlflow integration failed and is off for the rest of this run")
    assert "could not connect to the tracking server" in said
    assert _losses_in_wandb(tmp_path, spec.job_id) == STEPS
    assert _wandb_exit_codes(tmp_path, spec.job_id) == [0]

    # MLflow's store refuses writes after step 1: W&B gets every step and the end
    spec = _spec(mlflow(), w_and_b, job_id="ftjob-mlflowfull")
    with monkeypatch.context() as m:
        [said] = train(spec, lambda: m.setattr(MlflowClient, "log_batch", refuse))
    assert said.startswith("The mlflow integration failed") and "No space left on device" in said
    assert _losses_in_wandb(tmp_path, spec.job_id) == STEPS
    assert _wandb_exit_codes(tmp_path, spec.job_id) == [0]
    assert _losses_in_mlflow(uri, spec.job_id) == ({1: 1.0}, "RUNNING")  # before it failed

    # W&B fails after step 1: MLflow gets every step and the end
    spec = _spec(w_and_b, mlflow(), job_id="ftjob-wandbfull")
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
    _unset_after(monkeypatch, "MLFLOW_TRACKING_URI")
    spec = _spec(
        Integration(type="mlflow", mlflow=MlflowOptions(experiment_name="e")),
        Integration(type="mlflow", mlflow=MlflowOptions(tracking_uri="http://127.0.0.1:9")),
    )
    warnings: list[str] = []
    trackers = Trackers(
        spec,
        job_config(spec),
        warn=warnings.append,
        environment=operator_mlflow(uri),
        outbound=LOCAL,
    )
    for step, loss in STEPS.items():
        trackers.log(step, {"train_loss": loss})
    trackers.finish(completed=True)
    assert len(warnings) == 1 and "could not connect to the tracking server" in warnings[0]
    assert _losses_in_mlflow(uri, spec.job_id) == (STEPS, "FINISHED")


class _Server:
    """An HTTP server on 127.0.0.1 that answers every request ``status`` with ``body`` and
    counts the requests: a tracking server a tenant pointed at."""

    def __init__(self, status: int, body: bytes):
        server = self
        self.requests = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self) -> None:
                server.requests += 1
                self.send_response(status)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *_: Any) -> None:
                pass

        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.http.server_address[1]
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def __enter__(self) -> _Server:
        return self

    def __exit__(self, *_: object) -> None:
        self.http.shutdown()
        self.http.server_close()


def _mlflow_warnings(uri: str, policy: OutboundPolicy) -> list[str]:
    spec = _spec(Integration(type="mlflow", mlflow=MlflowOptions(tracking_uri=uri)))
    warnings: list[str] = []
    trackers = Trackers(spec, job_config(spec), warn=warnings.append, outbound=policy)
    trackers.log(1, {"train_loss": 1.0})
    trackers.finish(completed=True)
    return warnings


REFUSED = (
    "where TuneFleet sends nothing unless the operator allows it (TUNEFLEET_OUTBOUND_ALLOW: "
    "a host name, or a CIDR such as 10.0.0.0/8); give a public address"
)


def test_a_tracking_server_on_a_non_public_address_is_refused_before_mlflow_connects(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The run checks the tenant's tracking_uri again (the node's policy may be stricter
    than the API's was), and then every lookup MLflow makes: a name that resolves to
    127.0.0.1 when MLflow connects (DNS rebinding) is refused inside MLflow's own request,
    and the server there gets nothing."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with _Server(200, b"{}") as server:
        [said] = _mlflow_warnings(f"http://127.0.0.1:{server.port}", OutboundPolicy())
        assert said.endswith(
            f"refused: mlflow tracking_uri host '127.0.0.1' is a loopback address, {REFUSED}"
        )

        real = outbound._getaddrinfo

        def rebound(host: str, *args: Any, **kwargs: Any) -> Any:
            return real("127.0.0.1" if host == "mlflow.acme.example" else host, *args, **kwargs)

        monkeypatch.setattr(outbound, "_getaddrinfo", rebound)
        [said] = _mlflow_warnings(f"http://mlflow.acme.example:{server.port}", OutboundPolicy())
        assert said.endswith(
            "refused: mlflow tracking_uri host 'mlflow.acme.example' resolves to 127.0.0.1, "
            f"a loopback address, {REFUSED}"
        )
        assert server.requests == 0
    assert socket.getaddrinfo is outbound._system_getaddrinfo  # the guard is gone after


def test_what_a_tracking_server_answers_never_reaches_the_tenants_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    secret = b'{"error_code": "INTERNAL_ERROR", "message": "db password is hunter2"}'
    for body in (secret, b"<html>internal admin page: hunter2</html>"):
        with _Server(500, body) as server:
            [said] = _mlflow_warnings(f"http://127.0.0.1:{server.port}", LOCAL)
            assert server.requests >= 1  # allowed: it was asked
        assert "hunter2" not in said and "admin page" not in said, said
        assert "the tracking server refused or failed the request" in said
