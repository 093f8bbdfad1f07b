"""Controller benchmarks, three parts.

1. Planning throughput: ``scheduler.plan`` over 1,000 queued jobs of 20 tenants on a
   32-node cluster (and again with 8 node types the cluster can add), against a baseline
   in the same run: plain FIFO by priority then age with first-fit placement (no
   fairness, quotas or backfill), i.e. what the policy costs on top of the simplest
   scheduler.
2. Dispatch latency on a warm local Ray: time from job creation to its first training
   step, less the model load the run reports, split into creation -> dispatched (the
   controller's queueing and admission) and dispatched -> first step (Ray job start,
   Ray Train workers, data). One warm-up job first, then ``--jobs`` measured one at a time.
3. Capacity: on Ray's own autoscaler (fake multi-node provider), the time from the
   controller asking for a node of a group at zero to the job's first step, against a job
   on that node once it is up; and, in part 1, the plan time when 8 node types can grow.

    .venv/bin/python bench/controller.py [--jobs 3] [--plans 20]
Writes bench/results/controller.json.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import machine  # noqa: E402
from tunefleet.platform.scheduler import (  # noqa: E402
    Dispatch,
    Node,
    NodeType,
    QueuedJob,
    Snapshot,
    TenantQuota,
    plan,
)


def fifo_first_fit(snapshot: Snapshot) -> list[Dispatch]:
    """The baseline: priority then age, first node with room, nothing else."""
    free = {n.id: list(n.free) for n in snapshot.nodes}
    out = []
    for job in sorted(snapshot.queued, key=lambda j: (-j.priority, j.created_ns, j.id)):
        placed = []
        for _ in range(job.workers):
            node = next(
                (
                    k
                    for k, (c, g) in free.items()
                    if c >= job.cpus_per_worker and g >= job.gpus_per_worker
                ),
                None,
            )
            if node is None:
                break
            free[node][0] -= job.cpus_per_worker
            free[node][1] -= job.gpus_per_worker
            placed.append(node)
        if len(placed) == job.workers:
            out.append(Dispatch(job.id, tuple(placed)))
        else:
            for node in placed:
                free[node][0] += job.cpus_per_worker
                free[node][1] += job.gpus_per_worker
    return out


def planning(plans: int) -> dict[str, Any]:
    jobs = [
        QueuedJob(
            id=f"job-{i}",
            tenant_id=f"tenant-{i % 20}",
            created_ns=i * 1_000_000,
            priority=(i * 7) % 3,
            workers=1 + i % 4,
            cpus_per_worker=4,
            gpus_per_worker=1 + i % 2,
        )
        for i in range(1000)
    ]
    snapshot = Snapshot(
        queued=jobs,
        running=[],
        tenants={f"tenant-{t}": TenantQuota(f"tenant-{t}", 8, 64) for t in range(20)},
        nodes=[Node(f"node-{n}", cpus=64, gpus=8) for n in range(32)],
    )

    def timed(fn: Any) -> tuple[float, Any]:
        times, result = [], None
        for _ in range(plans):
            t0 = time.perf_counter()
            result = fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times), result

    policy_s, decisions = timed(lambda: plan(snapshot, 1e9))
    # the same queue on a cluster that can also grow: 8 node types of 1-8 GPUs, at most
    # 4 nodes each (the jobs that do not fit wait for nodes, each promised its own)
    growing = Snapshot(
        queued=snapshot.queued,
        running=[],
        tenants=snapshot.tenants,
        nodes=snapshot.nodes,
        node_types=[
            NodeType(f"group-{k}", cpus=16 * (1 + k % 4), gpus=2 ** (k % 4), max_count=4)
            for k in range(8)
        ],
    )
    growing_s, grown = timed(lambda: plan(growing, 1e9))
    baseline_s, baseline = timed(lambda: fifo_first_fit(snapshot))
    started = [d for d in decisions if isinstance(d, Dispatch)]
    tenant_of = {j.id: j.tenant_id for j in jobs}
    return {
        "queued_jobs": len(jobs),
        "tenants": 20,
        "nodes": 32,
        "policy_ms_per_plan": round(1000 * policy_s, 2),
        "policy_plans_per_s": round(1 / policy_s, 1),
        "baseline_fifo_ms_per_plan": round(1000 * baseline_s, 2),
        "policy_over_baseline": round(policy_s / baseline_s, 2),
        "policy_with_8_node_types_ms_per_plan": round(1000 * growing_s, 2),
        "node_types_over_live_nodes_only": round(growing_s / policy_s, 2),
        "waiting_for_new_nodes": sum(1 for d in grown if getattr(d, "grow", None)),
        "dispatched_policy": len(started),
        "dispatched_baseline": len(baseline),
        "tenants_started_policy": len({tenant_of[d.job_id] for d in started}),
        "tenants_started_baseline": len({tenant_of[d.job_id] for d in baseline}),
    }


def _prepare(**settings: Any) -> tuple[Any, str]:
    """A data folder with the tiny Llama, a migrated database, a tenant and its 4-line
    training file ``file-bench``: the settings (``settings`` on top) and the tenant's key."""
    from tinyllm import build_tiny_llama
    from tunefleet.platform.artifacts import ArtifactStore
    from tunefleet.platform.db import File, session_scope
    from tunefleet.platform.db.migrate import upgrade
    from tunefleet.platform.settings import Settings
    from tunefleet.platform.tenants import create_key, create_tenant

    data = Path(tempfile.mkdtemp(prefix="bench-controller-"))
    build_tiny_llama(data / "models" / "tiny-llama")
    prepared = Settings(data_dir=data, controller_interval_s=0.05, **settings)
    url = prepared.resolved_database_url
    upgrade(url)
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    store = ArtifactStore(prepared.resolved_artifact_root)
    store.write_bytes(store.file_key("file-bench"), (json.dumps(chat) + "\n").encode() * 4)
    with session_scope(url) as s:
        tenant = create_tenant(s, "bench")
        key = create_key(s, tenant.id)[1]
        s.add(
            File(
                id="file-bench", tenant_id=tenant.id, filename="t.jsonl", purpose="fine-tune",
                bytes=1, status="processed", format="chat", stats={}, path="files/file-bench",
            )
        )  # fmt: skip
    return prepared, key


def dispatch_latency(n_jobs: int) -> dict[str, Any]:
    from sqlalchemy import select

    from tunefleet.platform.db import Job, JobEvent, session_scope
    from tunefleet.platform.jobs import JobCreateRequest, create_job
    from tunefleet.platform.models import ModelRegistry
    from tunefleet.platform.tenants import authenticate
    from tunefleet.workers.backend import RayBackend
    from tunefleet.workers.controller import Controller

    settings, key = _prepare(ray_num_cpus=2)
    url = settings.resolved_database_url
    backend = RayBackend(settings)
    backend.connect()
    stop = threading.Event()
    controller = Controller(settings, backend)
    thread = threading.Thread(target=controller.run_forever, args=(stop,), daemon=True)
    thread.start()
    registry = ModelRegistry(settings.resolved_model_registry)
    rows = []
    try:
        for i in range(n_jobs + 1):
            with session_scope(url) as s:
                principal = authenticate(s, f"Bearer {key}")
                req = JobCreateRequest.model_validate(
                    {"model": "tiny-llama", "training_file": "file-bench", "seed": i,
                     "tunefleet": {"max_steps": 2}}
                )  # fmt: skip
                created = time.time()
                job_id = create_job(s, principal, req, registry).id
            dispatched = first_step = None
            load_s = None
            startup: dict[str, float] = {}
            while first_step is None or dispatched is None:
                with session_scope(url) as s:
                    for e in s.scalars(select(JobEvent).where(JobEvent.job_id == job_id)):
                        if dispatched is None and e.message.startswith("Dispatched"):
                            dispatched = time.time()
                        if e.data and "model_load_s" in e.data:
                            load_s = e.data["model_load_s"]
                            startup = e.data.get("startup", {})
                        if first_step is None and e.type == "metrics":
                            first_step = time.time()
                    status = s.scalar(select(Job.status).where(Job.id == job_id))
                assert status not in ("failed", "cancelled"), status
                time.sleep(0.02)
            while status not in ("succeeded",):
                time.sleep(0.2)
                with session_scope(url) as s:
                    status = s.scalar(select(Job.status).where(Job.id == job_id))
                assert status not in ("failed", "cancelled"), status
            if i == 0:
                continue  # warm-up: Ray's first job pays for worker start-up and imports
            assert load_s is not None
            rows.append(
                {
                    "created_to_dispatched_s": round(dispatched - created, 3),
                    "dispatched_to_first_step_s": round(first_step - dispatched, 3),
                    "model_load_s": load_s,
                    "created_to_first_step_less_load_s": round(first_step - created - load_s, 3),
                    "phases_s": _phases(dispatched, startup, first_step),
                }
            )
    finally:
        stop.set()
        thread.join(30)
        backend.shutdown()
    return {
        "jobs": rows,
        "median_created_to_first_step_less_load_s": statistics.median(
            r["created_to_first_step_less_load_s"] for r in rows
        ),
        "median_created_to_dispatched_s": statistics.median(
            r["created_to_dispatched_s"] for r in rows
        ),
    }


def autoscaling_latency() -> dict[str, Any]:
    """On Ray's own autoscaler (its fake multi-node provider, as tests/cluster/
    test_autoscaling.py): a job for a group at zero, from the controller asking for its
    node to the job's first step, against a second job on the node once it is there
    (dispatched to first step, warm)."""
    from sqlalchemy import select

    from raycluster import ray_cluster
    from tunefleet.platform.db import Job, JobEvent, session_scope
    from tunefleet.platform.jobs import JobCreateRequest, create_job
    from tunefleet.platform.models import ModelRegistry
    from tunefleet.platform.serving_contract import NODE_ROLE_LABEL
    from tunefleet.platform.settings import NodeTypeSetting
    from tunefleet.platform.tenants import authenticate
    from tunefleet.workers.backend import RayBackend
    from tunefleet.workers.controller import Controller

    custom = {"accelerator": 1.0, "tunefleet-driver": 100.0}
    group = {
        "resources": {"CPU": 2, **custom},
        "labels": {NODE_ROLE_LABEL: "training"},
        "node_config": {},
        "min_workers": 0,
        "max_workers": 1,
    }
    with ray_cluster(num_cpus=0, node_types={"accel": group}) as head:
        settings, key = _prepare(
            ray_address=head.address,
            ray_dashboard_url=head.dashboard,
            node_types=(NodeTypeSetting(name="accel", cpus=2, resources=custom, max_count=1),),
            run_driver_resources={"tunefleet-driver": 1},
        )
        url = settings.resolved_database_url
        backend = RayBackend(settings)
        backend.connect()
        stop = threading.Event()
        controller = Controller(settings, backend)
        thread = threading.Thread(target=controller.run_forever, args=(stop,), daemon=True)
        thread.start()
        registry = ModelRegistry(settings.resolved_model_registry)

        def create(seed: int) -> str:
            with session_scope(url) as s:
                request = JobCreateRequest.model_validate(
                    {"model": "tiny-llama", "training_file": "file-bench", "seed": seed,
                     "tunefleet": {"max_steps": 2, "resources": {
                         "custom_resources_per_worker": {"accelerator": 1}}}}
                )  # fmt: skip
                principal = authenticate(s, f"Bearer {key}")
                return create_job(s, principal, request, registry).id

        def times(job_id: str) -> dict[str, float]:
            """When the nodes were asked for, the job dispatched, its first step seen."""
            found: dict[str, float] = {}
            deadline = time.monotonic() + 600
            while "first_step" not in found:
                with session_scope(url) as s:
                    for e in s.scalars(select(JobEvent).where(JobEvent.job_id == job_id)):
                        if e.data and "capacity_requested_at" in e.data:
                            found.setdefault("requested", float(e.data["capacity_requested_at"]))
                        if e.message.startswith("Dispatched"):
                            found.setdefault("dispatched", time.time())
                        if e.type == "metrics":
                            found.setdefault("first_step", time.time())
                    status = s.scalar(select(Job.status).where(Job.id == job_id))
                assert status not in ("failed", "cancelled"), status
                assert time.monotonic() < deadline, f"{job_id} never stepped: {found}"
                time.sleep(0.02)
            return found

        def ended(job_id: str) -> None:
            deadline = time.monotonic() + 600
            while True:
                with session_scope(url) as s:
                    status = s.scalar(select(Job.status).where(Job.id == job_id))
                if status in ("succeeded", "failed", "cancelled"):
                    return
                assert time.monotonic() < deadline, f"{job_id} never ended: {status}"
                time.sleep(0.1)

        try:
            cold_id = create(1)
            cold = times(cold_id)
            # the warm job on the node now up, once the cold one has left it (on 2 CPUs, a
            # run ending beside a run starting would slow the warm one)
            ended(cold_id)
            warm = times(create(2))
        finally:
            stop.set()
            thread.join(30)
            backend.shutdown()
    cold_s = cold["first_step"] - cold["requested"]
    warm_s = warm["first_step"] - warm["dispatched"]
    return {
        "capacity_requested_to_first_step_s": round(cold_s, 3),
        "capacity_requested_to_dispatched_s": round(cold["dispatched"] - cold["requested"], 3),
        "warm_dispatched_to_first_step_s": round(warm_s, 3),
        "cold_over_warm": round(cold_s / warm_s, 2),
    }


def _phases(dispatched: float, startup: dict[str, float], first_step: float) -> dict[str, float]:
    """Where dispatch -> first step went, from the timestamps the run reports (``startup``
    in its "Training ..." event): the Ray job's start (Jobs API, supervisor, driver
    process), the driver's imports and connection, Ray Train's controller and worker
    group, the worker's imports, the loop's set-up, the first step."""
    marks = [
        ("ray_job_start", startup.get("driver_process")),
        ("driver_to_trainer_fit", startup.get("trainer_fit")),
        ("trainer_fit_to_worker_process", startup.get("worker_process")),
        ("worker_imports", startup.get("train_fn")),
        ("loop_setup", startup.get("setup_done")),
        ("first_step", first_step),
    ]
    phases, last = {}, dispatched
    for name, at in marks:
        if at is not None:
            phases[name] = round(at - last, 3)
            last = at
    return phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=3)
    parser.add_argument("--plans", type=int, default=20)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # one token for both of the run's Ray clusters (a process reads it once), never the
    # user's ~/.ray/auth_token
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(16))
    out = {
        "benchmark": "controller",
        "machine": machine.describe(),
        "planning": planning(args.plans),
        "dispatch": dispatch_latency(args.jobs),
        "autoscaling": autoscaling_latency(),
    }
    dest = ROOT / "bench" / "results" / "controller.json"
    dest.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
