"""Faults on real processes of the embedded default: `tunefleet up` (API, controller and
its own local Ray in one process) on PostgreSQL. The database server stops for 10 s while
a job trains, then `tunefleet up` is killed with SIGKILL mid-training (its Ray goes with
it) and started again: the job continues from its newest checkpoint, succeeds exactly
once, and its events and metrics are complete (a run waits at each checkpoint until what it
reported is written, so no checkpoint is newer than the metrics on record). The tenant's
webhook endpoint, refusing until the restart, then gets each job's end once, signed."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from conftest import auth
from pg import PgServer, postgres_server
from raycluster import free_port, stop_process
from webhook_receiver import Receiver

pytestmark = pytest.mark.slow

TINY = "tiny-llama"
EVERY = 10  # checkpoint every this many steps
OUTAGE_S = 10


@pytest.fixture
def database() -> Iterator[PgServer]:
    """A PostgreSQL server of this test's own, so that stopping it touches nothing else."""
    with postgres_server() as server:
        yield server


def _up(env: dict[str, str], log_path: Path, nth: int) -> subprocess.Popen[bytes]:
    """The ``nth`` `tunefleet up` on this data, once it says it is ready."""
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tunefleet.cli.main", "up", "--no-builtin-model"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 180
    while log_path.read_text().count("Ready. Ctrl-C stops.") < nth:
        assert proc.poll() is None, log_path.read_text()[-4000:]
        assert time.monotonic() < deadline, "tunefleet up did not become ready"
        time.sleep(0.3)
    return proc


def _embedded_ray_processes(data: Path) -> list[psutil.Process]:
    """The processes of the embedded Ray that `tunefleet up` on ``data`` started."""
    marker = json.loads((data / "embedded-ray-id").read_text())
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("TUNEFLEET_EMBEDDED_RAY") == marker["id"] or any(
                f.path.startswith(marker["session_dir"]) for f in proc.open_files()
            ):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def _job(client: httpx.Client, job_id: str) -> dict[str, Any]:
    return dict(client.get(f"/v1/fine_tuning/jobs/{job_id}").json())


def _events(client: httpx.Client, job_id: str) -> list[dict[str, Any]]:
    """Every event of the job, oldest first (paging through the API)."""
    out: list[dict[str, Any]] = []
    after = None
    while True:
        params: dict[str, Any] = {"limit": 100, **({"after": after} if after else {})}
        page = client.get(f"/v1/fine_tuning/jobs/{job_id}/events", params=params).json()
        out.extend(page["data"])
        if not page["has_more"]:
            return out[::-1]
        after = page["data"][-1]["id"]


def _story(client: httpx.Client, job_id: str, log_path: Path) -> str:
    """What went on, for a failure message: the job's events other than metrics, then what the
    controller logged (a string: pytest shows it whole, where it cuts a tuple's repr)."""
    events = [
        f"{e['created_at']} {e['level']}: {e['message'][:400]}"
        for e in _events(client, job_id)
        if e["type"] != "metrics"
    ]
    said = [
        line[:400]
        for line in log_path.read_text().splitlines()
        if "tunefleet.workers" in line or "Error" in line
    ]
    return "\n".join(["events:", *events, "controller:", *said[-40:]])


def _wait_step(client: httpx.Client, job_id: str, step: int, timeout: float = 240) -> int:
    deadline = time.monotonic() + timeout
    while True:
        steps = [e["data"]["step"] for e in _events(client, job_id) if e["type"] == "metrics"]
        if steps and steps[-1] >= step:
            return int(steps[-1])
        job = _job(client, job_id)
        if job["status"] not in ("validating_files", "queued", "running"):
            for e in _events(client, job_id):  # shown whole with the failure (not cut)
                print(e["created_at"], e["level"], e["message"][:300], e.get("data"))
        assert job["status"] in ("validating_files", "queued", "running"), job.get("error")
        assert time.monotonic() < deadline, f"step {step} not reached: {steps[-3:]}"
        time.sleep(0.5)


def test_postgres_away_then_tunefleet_up_killed_mid_training_lose_nothing(
    tmp_path: Path, tiny_registry: Path, database: PgServer, ray_cluster: Any
) -> None:
    # ``ray_cluster``: another Ray on this machine all along (the session's shared one), as
    # a user's own `ray start` would be. Ray's Jobs API hands a run's driver whichever
    # cluster on the machine its "auto" finds; the run must still reach its own.
    env = {
        **os.environ,
        "TUNEFLEET_DATA_DIR": str(tmp_path),
        "TUNEFLEET_DATABASE_URL": database.url,
        "TUNEFLEET_MODEL_REGISTRY": str(tiny_registry),
        "TUNEFLEET_API_PORT": str(free_port()),
        "TUNEFLEET_SERVE_PORT": str(free_port()),
        "TUNEFLEET_RAY_DASHBOARD_PORT": str(free_port()),
        "TUNEFLEET_CONTROLLER_INTERVAL_S": "0.3",
        # a pass stalled by training on 2 cores (the GIL, database writes) must not lose the
        # lease: 10 s is about 33 passes of 0.3 s
        "TUNEFLEET_CONTROLLER_LEASE_TTL_S": "10",
        # retries that go on past the kill and the restart (about 3 minutes in all)
        "TUNEFLEET_WEBHOOK_RETRY_DELAYS_S": "[1, 2, 4, 8, 16, 32, 32, 32, 32, 32]",
        # the receiver is on this machine, where webhooks go only when allowed
        "TUNEFLEET_OUTBOUND_ALLOW": '["127.0.0.1/32"]',
    }
    receiver = Receiver()
    receiver.refusing = True
    log_path = tmp_path / "up.log"
    up = _up(env, log_path, 1)
    try:
        url = f"http://127.0.0.1:{env['TUNEFLEET_API_PORT']}"
        printed = re.search(r"export OPENAI_API_KEY=(tf-\S+)", log_path.read_text())
        assert printed, log_path.read_text()
        client = httpx.Client(base_url=url, timeout=60, headers=auth(printed.group(1)))
        tenants = client.get("/v1/admin/tenants").json()["data"]
        default = next(t["id"] for t in tenants if t["name"] == "default")
        hook = client.post(
            f"/v1/admin/tenants/{default}/webhooks", json={"url": receiver.url}
        ).json()
        receiver.secret = hook["secret"]
        rows = [
            {
                "messages": [
                    {"role": "user", "content": f"say {i}"},
                    {"role": "assistant", "content": f"{i}"},
                ]
            }
            for i in range(8)
        ]
        body = "".join(json.dumps(r) + "\n" for r in rows).encode()
        f = client.post(
            "/v1/files", data={"purpose": "fine-tune"}, files={"file": ("t.jsonl", body)}
        ).json()
        job_id = client.post(
            "/v1/fine_tuning/jobs",
            json={
                "model": TINY,
                "training_file": f["id"],
                "seed": 3,
                "hyperparameters": {"n_epochs": 50, "batch_size": 1},
                "tunefleet": {"checkpoint_every_steps": EVERY},
            },
        ).json()["id"]

        # A second job, cancelled at once: its webhook is refused until after the restart.
        cancelled = client.post(
            "/v1/fine_tuning/jobs", json={"model": TINY, "training_file": f["id"]}
        ).json()["id"]
        assert client.post(f"/v1/fine_tuning/jobs/{cancelled}/cancel").status_code == 200

        # The database server stops for 10 s while the job trains.
        before = _wait_step(client, job_id, 3)
        database.stop()
        time.sleep(OUTAGE_S)
        database.start()
        after = _wait_step(client, job_id, before + 1)

        # Then `tunefleet up` dies mid-training, past at least one checkpoint.
        _wait_step(client, job_id, max(after, EVERY) + 3)
        assert receiver.got, "no webhook attempt before the kill"
        up.send_signal(signal.SIGKILL)
        up.wait(30)
        folder = tmp_path / "artifacts" / "checkpoints" / job_id
        checkpoints = sorted(int(p.name.split("-")[1]) for p in folder.glob("step-*"))
        assert checkpoints, "no checkpoint before the kill"

        # Its embedded Ray's agents and the run's driver outlive it (about a minute, until
        # they give up on the dead GCS); the restart stops them before Ray starts again.
        leftovers = _embedded_ray_processes(tmp_path)
        assert leftovers, "nothing of the killed stack's Ray was left to stop"
        up = _up(env, log_path, 2)
        receiver.refusing = False
        assert not any(p.is_running() for p in leftovers)
        assert re.search(
            r"stopped \d+ process\(es\) a previous embedded Ray left", log_path.read_text()
        )
        deadline = time.monotonic() + 400
        while (job := _job(client, job_id))["status"] not in ("succeeded", "failed", "cancelled"):
            assert time.monotonic() < deadline, job
            assert up.poll() is None, log_path.read_text()[-4000:]
            time.sleep(1)
        assert job["status"] == "succeeded", _story(client, job_id, log_path)

        events = _events(client, job_id)
        messages = [e["message"] for e in events]
        assert sum(m.startswith("The job has successfully completed") for m in messages) == 1
        metrics = [e["data"] for e in events if e["type"] == "metrics"]
        total = metrics[-1]["total_steps"]
        steps = [m["step"] for m in metrics]
        # the next run went on from the newest checkpoint (its workers outlived the kill by a
        # moment: it may be newer than the newest seen then)
        resumed = [int(m.rsplit(" ", 1)[1]) for m in messages if "resumed at step" in m]
        assert len(resumed) == 1 and resumed[0] >= checkpoints[-1], (resumed, checkpoints)
        newest = resumed[0]
        # every step is there, the outage's included. The steps trained past the newest
        # checkpoint before the kill appear twice, as far as the controller wrote them
        # before the kill (the rest went with the killed Ray's run channels: the next run
        # trained them again and said so)
        assert sorted(set(steps)) == list(range(1, total + 1)), steps
        restarted = next((i for i in range(1, len(steps)) if steps[i] <= steps[i - 1]), None)
        if restarted is None:
            assert steps == list(range(1, total + 1)), steps
        else:
            assert steps[:restarted] == list(range(1, steps[restarted - 1] + 1)), steps
            assert steps[restarted - 1] >= newest and steps[restarted] == newest + 1, steps
            assert steps[restarted:] == list(range(newest + 1, total + 1)), steps
        # no run recorded a failure: the killed one's driver was stopped before it could
        assert not [e for e in events if e["level"] == "error"], messages
        # and none failed: each driver reached its own cluster, not the other Ray
        assert not [m for m in messages if re.match(r"Ray job \S+ failed", m)], messages

        # Each job's end reached the endpoint once, signed, the refused one after the
        # restart (the outbox outlived the kill), with every refusal in its log.
        deadline = time.monotonic() + 120
        while len([g for g in receiver.got if g["status"] == 200]) < 2:
            assert time.monotonic() < deadline, receiver.got
            time.sleep(0.5)
        assert all(g["valid"] for g in receiver.got), receiver.got
        accepted = {g["body"]["data"]["id"]: g for g in receiver.got if g["status"] == 200}
        assert {j: g["body"]["type"] for j, g in accepted.items()} == {
            cancelled: "fine_tuning.job.cancelled",
            job_id: "fine_tuning.job.succeeded",
        }
        ids = [g["headers"]["webhook-id"] for g in receiver.got if g["status"] == 200]
        assert len(ids) == len(set(ids)) == 2
        log = client.get(f"/v1/admin/webhooks/{hook['id']}/deliveries").json()["data"]
        refused = next(d for d in log if d["job_id"] == cancelled)
        assert refused["status"] == "delivered" and refused["attempts"] >= 2
        assert [a["status_code"] for a in refused["log"]][:-1] == [503] * (refused["attempts"] - 1)
    finally:
        receiver.stop()
        print(log_path.read_text()[-8000:])  # shown when the test fails
        stop_process(up, grace_s=60)
