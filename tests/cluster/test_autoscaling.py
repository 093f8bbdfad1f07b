"""Elastic clusters on Ray's own autoscaler: a head with no CPUs for work, whose autoscaler
(its fake multi-node provider: real node processes that the real autoscaler starts and
stops on this machine) can add up to 2 nodes of group "accel". Their "accelerator"
resource stands for a GPU (this machine has none); "tunefleet-driver" is what the chart's
worker groups advertise for runs' drivers. One `tunefleet controller` process runs with
the settings the chart gives it: the node types (``TUNEFLEET_NODE_TYPES``) and the
drivers' resource.

- A job that needs the group waits for the autoscaler (its events say so, and when the
  nodes were asked for), runs once the node is there, and the group scales back to zero.
  A second job, created as the first starts, gets a node of its own while the first
  trains (its run start overlaps the first's: the module's time) and keeps it until its
  run is placed: this is the job preempted below.
- A job larger than any node type can ever hold is rejected at once, naming it.
- A node drained for preemption (``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION``
  with a deadline, what the chart's preStop hook and KubeRay run) makes its run
  checkpoint and leave; the job resumes on a new node, spends no retry and has the same
  losses as the job trained straight through.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from ray.scripts.scripts import drain_node

from conftest import CLI, TINY, add_chat_file
from raycluster import free_port, ray_cluster, ray_node, stop_process
from tinyllm import multiplier_for
from tunefleet.platform.artifacts import ArtifactStore
from tunefleet.platform.db import Job, JobEvent, session_scope
from tunefleet.platform.jobs import JobCreateRequest, create_job
from tunefleet.platform.models import ModelRegistry
from tunefleet.platform.serving_contract import NODE_ROLE_LABEL
from tunefleet.platform.settings import Settings
from tunefleet.platform.tenants import authenticate, create_key, create_tenant

pytestmark = [pytest.mark.slow]

GROUP = "accel"
NODE = {"CPU": 2, "accelerator": 1, "tunefleet-driver": 100}
CUSTOM = {k: v for k, v in NODE.items() if k != "CPU"}
STEPS = 40  # 9 s here: the drain reaches the run with steps to spare
ACCELERATED = {"custom_resources_per_worker": {"accelerator": 1}}


@pytest.fixture(scope="module")
def elastic(
    tmp_path_factory: pytest.TempPathFactory, tiny_registry: Path, sqlite_template: Path
) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("elastic")
    shutil.copyfile(sqlite_template, root / "tunefleet.db")
    node_types = {
        GROUP: {
            "resources": NODE,
            # as the chart labels a GPU group's nodes: no Serve replica there (one
            # reserves its node's memory, and the group would not scale back to zero)
            "labels": {NODE_ROLE_LABEL: "training"},
            "node_config": {},
            "min_workers": 0,
            "max_workers": 2,
        }
    }
    with ray_cluster(num_cpus=0, node_types=node_types) as head:
        settings = Settings(
            data_dir=root / "data",
            database_url=f"sqlite:///{root / 'tunefleet.db'}",
            model_registry=tiny_registry,
            artifact_root=str(root / "artifacts"),
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith("TUNEFLEET_")}
        env.update(
            TUNEFLEET_DATA_DIR=str(settings.data_dir),
            TUNEFLEET_DATABASE_URL=settings.database_url,
            TUNEFLEET_MODEL_REGISTRY=str(tiny_registry),
            TUNEFLEET_ARTIFACT_ROOT=settings.artifact_root,
            TUNEFLEET_RAY_ADDRESS=head.address,
            TUNEFLEET_RAY_DASHBOARD_URL=head.dashboard,
            TUNEFLEET_SERVE_PORT=str(free_port()),
            TUNEFLEET_CONTROLLER_INTERVAL_S="0.3",
            # as the chart renders them from its worker groups
            TUNEFLEET_NODE_TYPES=json.dumps(
                [
                    {
                        "name": GROUP,
                        "cpus": 2,
                        "gpus": 0,
                        "resources": CUSTOM,
                        "max_count": 2,
                    }
                ]
            ),
            TUNEFLEET_RUN_DRIVER_RESOURCES='{"tunefleet-driver": 1}',
        )
        port = free_port()
        log = root / "controller.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [*CLI, "controller", "--health-port", str(port)],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            yield {"settings": settings, "head": head, "env": env, "log": log, "proc": proc}
        finally:
            stop_process(proc, grace_s=20)


def _job(settings: Settings, tenant_name: str, **tunefleet: Any) -> str:
    store = ArtifactStore(settings.resolved_artifact_root)
    with session_scope(settings.resolved_database_url) as s:
        tenant = create_tenant(s, tenant_name)
        _, key = create_key(s, tenant.id)
        # 2 steps an epoch, a checkpoint at each epoch's end: slower steps, more time for
        # a drain to reach the run before its end
        file_id = add_chat_file(s, store, tenant.id, f"file-{tenant_name}", copies=4)
        request = JobCreateRequest.model_validate(
            {
                "model": TINY,
                "training_file": file_id,
                "seed": 5,
                "method": {
                    "type": "supervised",
                    "supervised": {
                        "hyperparameters": {
                            "n_epochs": 50,
                            "batch_size": 2,
                            "learning_rate_multiplier": multiplier_for(1e-2),
                        }
                    },
                },
                "tunefleet": {
                    "lora": {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["all-linear"]},
                    "max_steps": STEPS,
                    "checkpoint_every_steps": 1000,
                    **tunefleet,
                },
            }
        )
        principal = authenticate(s, f"Bearer {key}")
        return create_job(s, principal, request, ModelRegistry(settings.resolved_model_registry)).id


def _wait(
    elastic: dict[str, Any], job_id: str, pred: Any, what: str, timeout: float = 300
) -> tuple[Job, list[JobEvent]]:
    deadline = time.monotonic() + timeout
    while True:
        with session_scope(elastic["settings"].resolved_database_url) as s:
            job = s.get(Job, job_id)
            assert job is not None
            events = list(
                s.query(JobEvent).filter(JobEvent.job_id == job_id).order_by(JobEvent.seq)
            )
            s.expunge_all()
        if pred(job, events):
            return job, events
        assert elastic["proc"].poll() is None, elastic["log"].read_text()[-4000:]
        assert time.monotonic() < deadline, (
            f"timed out waiting for {what}: {job.status}, {[e.message for e in events][-5:]}\n"
            + elastic["log"].read_text()[-3000:]
            + _autoscaler_log(elastic)
        )
        time.sleep(0.5)


def _autoscaler_log(elastic: dict[str, Any]) -> str:
    """The end of the autoscaler's log: what it saw and launched (a job once waited 300 s
    for a node it never added, in a run beside another suite's leftovers)."""
    logs = sorted(elastic["head"].temp_dir.glob("session_*/logs/monitor.log"))
    return f"\n--- monitor.log\n{logs[-1].read_text()[-6000:]}" if logs else ""


def _group_nodes(elastic: dict[str, Any]) -> list[str]:
    """The live nodes of the group, from the head's state API."""
    token = {"Authorization": f"Bearer {os.environ['RAY_AUTH_TOKEN']}"}
    reply = httpx.get(
        f"{elastic['head'].dashboard}/api/v0/nodes",
        params={"limit": 100},
        headers=token,
        timeout=30,
    )
    nodes = reply.json()["data"]["result"]["result"]
    return [
        n["node_id"]
        for n in nodes
        if n["state"] == "ALIVE" and "accelerator" in n["resources_total"]
    ]


def _losses(events: list[JobEvent]) -> list[float]:
    return [e.data["train_loss"] for e in events if e.type == "metrics" and e.data]


def _steps(events: list[JobEvent]) -> list[int]:
    return [e.data["step"] for e in events if e.type == "metrics" and e.data]


@pytest.fixture(scope="module")
def jobs(elastic: dict[str, Any]) -> dict[str, str]:
    """Two jobs for the group, at zero when the first is created: "straight", followed to
    its end, and "preempted", created once the first is dispatched. The second waits for
    a node of its own and starts while the first trains: the module's two run starts
    overlap, not one after the other (each is about 25 s on a 2-core EPYC)."""
    assert _group_nodes(elastic) == []
    straight = _job(elastic["settings"], "acme", resources=ACCELERATED)
    job, _ = _wait(elastic, straight, lambda j, ev: j.placement is not None, "the first dispatch")
    # the node the autoscaler added is seen as the group's (it outlives the run by the
    # group's idle timeout): the checks of zero above and at the end could fail
    assert set(job.placement["nodes"]) <= set(_group_nodes(elastic))  # type: ignore[index]
    preempted = _job(elastic["settings"], "globex", resources=ACCELERATED)
    return {"straight": straight, "preempted": preempted}


def _ended(elastic: dict[str, Any], job_id: str) -> tuple[Job, list[JobEvent]]:
    return _wait(
        elastic, job_id, lambda j, ev: j.status in ("succeeded", "failed"), "the job to end"
    )


@pytest.fixture(scope="module")
def straight(elastic: dict[str, Any], jobs: dict[str, str]) -> dict[str, Any]:
    """The job trained straight through, followed to its end."""
    job, events = _ended(elastic, jobs["straight"])
    assert job.status == "succeeded", (job.error, [e.message for e in events])
    return {"job": job, "events": events}


def test_a_preempted_nodes_run_checkpoints_and_resumes_on_a_new_node_with_the_same_losses(
    elastic: dict[str, Any], jobs: dict[str, str]
) -> None:
    job_id = jobs["preempted"]
    job, _ = _wait(elastic, job_id, lambda j, ev: j.placement is not None, "the dispatch")
    (node,) = set(job.placement["nodes"])  # type: ignore[index]
    job, _ = _wait(elastic, job_id, lambda j, ev: len(_steps(ev)) >= 3, "three steps")
    drained_at = time.time()
    # `ray drain-node`, run here rather than as a process: a new Python that imports Ray
    # took seconds under load, while the run's steps went on (its last step came before
    # the drain once in CI)
    drain_node.main(
        [
            *("--address", elastic["head"].address, "--node-id", node),
            *("--reason", "DRAIN_NODE_REASON_PREEMPTION"),
            *("--reason-message", "spot instance reclaimed"),
            *("--deadline-remaining-seconds", "60"),
        ],
        standalone_mode=False,
    )
    # The cloud's replacement, joining after the notice. Ray's fake provider keeps listing
    # an instance whose raylet left after its drain (no cloud takes it away) and counts it
    # as pending capacity, so its autoscaler would never add one: a node of the group's
    # shape joins by hand. Started after the drain, not beside the two run starts (a
    # `ray start` then timed out reaching the GCS on 2 busy CPUs). The job resumes on it,
    # or on the first job's node if that job has ended.
    with ray_node(elastic["head"], num_cpus=2, resources=json.dumps(CUSTOM)):
        job, events = _ended(elastic, job_id)
    messages = [e.message for e in events]
    assert job.status == "succeeded" and job.failures == 0, (job.error, messages)
    assert any(
        m.startswith(f"Node(s) {node} (deadline in ") and "are being drained" in m for m in messages
    ), messages
    dispatched = [e for e in events if e.message.startswith("Dispatched as Ray job")]
    assert [e.data["attempt"] for e in dispatched] == [1, 2]  # type: ignore[index]
    # the checkpoint taken at the drain notice: the newest before the second run
    checkpoint, saved_at = max(
        (e.data["step"], e.created_at)  # type: ignore[index]
        for e in events
        if e.message.startswith("Checkpoint saved at step") and e.seq < dispatched[1].seq
    )
    assert saved_at - drained_at < 60, "checkpointed within the drain's deadline"
    assert dispatched[1].message.endswith(f"it resumes from the checkpoint at step {checkpoint}")
    assert node not in dispatched[1].data["nodes"]  # type: ignore[index]
    assert 3 <= checkpoint < STEPS
    assert _steps(events) == list(range(1, STEPS + 1)), "resumed at the checkpoint, no step twice"
    _, straight = _ended(elastic, jobs["straight"])
    assert _losses(events) == _losses(straight)


def test_a_job_for_a_group_at_zero_waits_for_the_autoscaler_runs_and_the_group_scales_back(
    elastic: dict[str, Any], straight: dict[str, Any]
) -> None:
    job, events = straight["job"], straight["events"]
    messages = [e.message for e in events]
    waited = [m for m in messages if "waiting for the autoscaler" in m]
    assert waited and waited[0].startswith(
        "Waiting in queue at position 1: waiting for the autoscaler to add 1 node(s) of "
        f"group {GROUP} (requested at "
    ), messages
    wait_event = next(e for e in events if "waiting for the autoscaler" in e.message)
    assert wait_event.data is not None
    assert wait_event.data["capacity_request"] == {
        "nodes": {GROUP: 1},
        "bundles": [{"CPU": 1, "accelerator": 1}],
    }
    dispatched = [e for e in events if e.message.startswith("Dispatched as Ray job")]
    assert len(dispatched) == 1 and dispatched[0].seq > wait_event.seq
    assert _steps(events) == list(range(1, STEPS + 1)) and job.failures == 0
    # the request withdrawn and the node idle: the group is back to zero
    deadline = time.monotonic() + 90
    while _group_nodes(elastic):
        assert time.monotonic() < deadline, "the group never scaled back to zero"
        time.sleep(1)


def test_a_job_larger_than_any_node_type_is_rejected_at_once_naming_the_largest(
    elastic: dict[str, Any],
) -> None:
    job_id = _job(elastic["settings"], "initech", resources={**ACCELERATED, "num_workers": 3})
    job, _ = _wait(
        elastic,
        job_id,
        lambda j, ev: j.status != "validating_files" and j.status != "queued",
        "the rejection",
        timeout=60,
    )
    assert job.status == "failed" and job.error is not None
    assert job.error["code"] == "does_not_fit_cluster"
    assert "3 worker(s)" in job.error["message"]
    assert f"the largest node of node type '{GROUP}' (at most 2) with 2 CPU" in job.error["message"]
