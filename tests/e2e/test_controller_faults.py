"""The controller on a real Ray cluster (``ray start``, so Ray outlives controllers):
fair scheduling of two tenants on two CPU slots, and SIGKILL at each step of dispatch
with a restart after each: every job ends right, with exactly one training run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from conftest import add_chat_file
from raycluster import free_port, stop_process
from raycluster import ray_cluster as start_ray_cluster
from tunefleet.platform.artifacts import ArtifactStore
from tunefleet.platform.db import (
    Checkpoint,
    Eval,
    EvalOutputItem,
    EvalRun,
    Job,
    JobEvent,
    session_scope,
)
from tunefleet.platform.db.migrate import upgrade
from tunefleet.platform.evals import CustomDataSourceConfig
from tunefleet.platform.jobs import JobCreateRequest, create_job
from tunefleet.platform.models import ModelRegistry
from tunefleet.platform.tenants import authenticate, create_key, create_tenant

pytestmark = pytest.mark.slow

TINY = "tiny-llama"
STEPS = 6


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    """A cluster of two CPU slots of this module's own (the fairness test counts them),
    started with ``ray start`` so that it outlives the controllers killed here."""
    with start_ray_cluster(num_cpus=2) as cluster:
        yield cluster


@pytest.fixture
def platform(tmp_path: Path, tiny_registry: Path, ray_cluster: Any) -> dict[str, Any]:
    url = f"sqlite:///{tmp_path / 'tunefleet.db'}"
    upgrade(url)
    env = {
        **os.environ,
        **ray_cluster.env(),
        "TUNEFLEET_DATA_DIR": str(tmp_path),
        "TUNEFLEET_DATABASE_URL": url,
        "TUNEFLEET_MODEL_REGISTRY": str(tiny_registry),
        "TUNEFLEET_SERVE_PORT": str(free_port()),
        "TUNEFLEET_CONTROLLER_INTERVAL_S": "0.3",
        # 20 passes of 0.3 s: a pass stalled by a run's start on 2 cores keeps the lease;
        # each restart here waits out a killed controller's lease, so no longer than that
        "TUNEFLEET_CONTROLLER_LEASE_TTL_S": "6",
    }
    return {
        "url": url,
        "env": env,
        "dir": tmp_path,
        "registry": tiny_registry,
        "address": ray_cluster.address,
        "dashboard": ray_cluster.dashboard,
    }


def _jobs(p: dict[str, Any], per_tenant: dict[str, int]) -> list[str]:
    """Create ``n`` small jobs for each tenant, in the order given; returns their ids."""
    store = ArtifactStore(p["dir"] / "artifacts")
    ids = []
    with session_scope(p["url"]) as s:
        for name, n in per_tenant.items():
            tenant = create_tenant(s, name)
            principal = authenticate(s, f"Bearer {create_key(s, tenant.id)[1]}")
            file_id = add_chat_file(s, store, tenant.id, f"file-{name}", copies=4)
            for i in range(n):
                req = JobCreateRequest.model_validate(
                    {
                        "model": TINY,
                        "training_file": file_id,
                        "seed": i,
                        "suffix": f"{name}{i}",
                        "tunefleet": {"max_steps": STEPS, "checkpoint_every_steps": 2},
                    }
                )
                ids.append(create_job(s, principal, req, ModelRegistry(p["registry"])).id)
                s.flush()
    return ids


def _controller(
    p: dict[str, Any], failpoint: str | None = None
) -> tuple[subprocess.Popen[bytes], Path]:
    """A ``tunefleet controller`` process and its log file."""
    env = dict(p["env"])
    if failpoint:
        env["TUNEFLEET_FAILPOINT"] = failpoint
    path = p["dir"] / f"controller-{time.monotonic_ns()}.log"
    with path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tunefleet.cli.main", "controller"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return proc, path


def _statuses(url: str, ids: list[str]) -> dict[str, str]:
    with session_scope(url) as s:
        return dict(s.execute(select(Job.id, Job.status).where(Job.id.in_(ids))).all())


def _wait_terminal(
    p: dict[str, Any], ids: list[str], procs: list[Any], timeout: float = 400
) -> None:
    deadline = time.monotonic() + timeout
    while any(
        v not in ("succeeded", "failed", "cancelled") for v in _statuses(p["url"], ids).values()
    ):
        if time.monotonic() > deadline:
            logs = "\n".join(f.read_text()[-3000:] for f in p["dir"].glob("controller-*.log"))
            raise AssertionError(f"jobs did not finish: {_statuses(p['url'], ids)}\n{logs}")
        assert any(proc.poll() is None for proc in procs), "no controller is alive"
        time.sleep(0.5)


def _ray_runs(p: dict[str, Any]) -> dict[str, list[str]]:
    """Ray job submission ids per TuneFleet job: the training runs, counted at Ray."""
    from ray.job_submission import JobSubmissionClient

    runs: dict[str, list[str]] = {}
    for info in JobSubmissionClient(p["dashboard"]).list_jobs():
        job_id = (info.metadata or {}).get("tunefleet_job_id")
        if job_id:
            runs.setdefault(job_id, []).append(str(info.submission_id))
    return runs


def _events(url: str, job_id: str) -> list[JobEvent]:
    with session_scope(url) as s:
        rows = list(
            s.scalars(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.seq))
        )
        for r in rows:
            s.expunge(r)
        return rows


def test_two_tenants_share_two_slots_fairly(platform: dict[str, Any]) -> None:
    ids = _jobs(platform, {"acme": 3, "globex": 2})  # acme queued all of its jobs first
    ctl, _ = _controller(platform)
    try:
        _wait_terminal(platform, ids, [ctl])
    finally:
        stop_process(ctl)
    assert set(_statuses(platform["url"], ids).values()) == {"succeeded"}
    with session_scope(platform["url"]) as s:
        history = list(
            s.execute(
                select(JobEvent.job_id, JobEvent.message)
                .where(JobEvent.job_id.in_(ids))
                .where(
                    JobEvent.message.like("Dispatched as Ray job%")
                    | JobEvent.message.like("The job has successfully completed%")
                )
                .order_by(JobEvent.seq)
            )
        )
    tenant_of = {j: ("acme" if i < 3 else "globex") for i, j in enumerate(ids)}
    # Every start goes to the tenant with fewer jobs running at that moment, as long as
    # the other still has jobs waiting (dominant-share fairness, equal weights): the
    # first pass fills both slots with one job of each tenant, though globex queued after
    # all of acme's, and later starts alternate while both tenants wait.
    running = {"acme": 0, "globex": 0}
    waiting = {"acme": 3, "globex": 2}
    order = []
    for job_id, message in history:
        tenant = tenant_of[job_id]
        if message.startswith("The job has successfully completed"):
            running[tenant] -= 1
            continue
        other = "globex" if tenant == "acme" else "acme"
        assert waiting[other] == 0 or running[tenant] <= running[other], (history, running)
        running[tenant] += 1
        waiting[tenant] -= 1
        order.append(tenant)
    assert sorted(order[:2]) == ["acme", "globex"], order
    assert order.count("acme") == 3 and order.count("globex") == 2
    waiting = [e.message for e in _events(platform["url"], ids[1])]
    assert any(m.startswith("Waiting in queue at position") for m in waiting), waiting
    runs = _ray_runs(platform)
    assert all(len(runs[j]) == 1 for j in ids), runs


def test_sigkill_at_each_step_of_dispatch_loses_nothing_and_trains_once(
    platform: dict[str, Any],
) -> None:
    ids = _jobs(platform, {"initech": 1, "umbrella": 1})
    for point in ("dispatch.after_commit", "dispatch.after_submit", "follow.running"):
        ctl, _ = _controller(platform, failpoint=point)
        assert ctl.wait(240) == -signal.SIGKILL, f"controller did not die at {point}"
    # Two controllers: one leads; kill it as well, the standby takes over and finishes.
    (first, first_log), (second, second_log) = _controller(platform), _controller(platform)
    try:
        deadline = time.monotonic() + 120
        while not any("controller leads" in f.read_text() for f in (first_log, second_log)):
            assert time.monotonic() < deadline, "no controller took the lead"
            time.sleep(0.3)
        leader, standby = (
            (first, second) if "controller leads" in first_log.read_text() else (second, first)
        )
        os.killpg(leader.pid, signal.SIGKILL)
        _wait_terminal(platform, ids, [standby])
        standby_log = second_log if standby is second else first_log
        assert "controller leads" in standby_log.read_text()
    finally:
        stop_process(first)
        stop_process(second)

    assert set(_statuses(platform["url"], ids).values()) == {"succeeded"}
    runs = _ray_runs(platform)
    for job_id in ids:
        assert runs[job_id] == [f"{job_id}-1"], runs  # one training run per job
        metrics = [e.data for e in _events(platform["url"], job_id) if e.type == "metrics"]
        total = metrics[-1]["total_steps"]  # 3 epochs of one step
        assert [m["step"] for m in metrics] == list(range(1, total + 1))  # none trained twice
    # the restarted controllers said so on the jobs they found running
    messages = [e.message for job_id in ids for e in _events(platform["url"], job_id)]
    assert any(m.startswith("Controller (term ") and "re-attached" in m for m in messages)


def test_sigkill_mid_eval_run_writes_every_output_item_exactly_once(
    platform: dict[str, Any],
) -> None:
    """The controller dies just after it writes a run's first output item (others in
    flight die with it); the next one finishes the run: every item once, none lost, the
    ones written before the kill kept as they were."""
    url, n = platform["url"], 40
    now = time.time_ns()
    exact = {
        "type": "string_check",
        "name": "exact",
        "input": "{{sample.output_text}}",
        "reference": "{{item.answer}}",
        "operation": "eq",
    }
    items = [
        {"item": {"answer": str(i)}, "sample": {"output_text": str(i if i % 2 else i + 1)}}
        for i in range(n)
    ]
    config = CustomDataSourceConfig(
        type="custom", item_schema={"type": "object"}, include_sample_schema=True
    )
    with session_scope(url) as s:
        tenant = create_tenant(s, "evalco")
        s.add(
            Eval(
                id="eval-faults",
                tenant_id=tenant.id,
                name="odd",
                data_source_config=config.view(),
                testing_criteria=[exact],
                metadata_={},
                created_ns=now,
                updated_ns=now,
            )
        )
        s.flush()
        s.add(
            EvalRun(
                id="evalrun-faults",
                eval_id="eval-faults",
                tenant_id=tenant.id,
                name="odd",
                status="queued",
                data_source={"type": "jsonl", "source": {"type": "file_content"}},
                items=items,
                metadata_={},
                result_counts={"total": n, "passed": 0, "failed": 0, "errored": 0},
                per_testing_criteria_results=[],
                per_model_usage=[],
                created_ns=now,
                updated_ns=now,
            )
        )

    def written() -> dict[int, str]:
        with session_scope(url) as s:
            rows = s.execute(
                select(EvalOutputItem.item_index, EvalOutputItem.id).where(
                    EvalOutputItem.run_id == "evalrun-faults"
                )
            )
            return dict(rows.all())

    ctl, _ = _controller(platform, failpoint="evals.after_item")
    assert ctl.wait(240) == -signal.SIGKILL, "controller did not die after an item"
    before = written()
    assert 1 <= len(before) < n, len(before)  # 16 in flight at most: the kill was mid-run
    ctl, log = _controller(platform)
    try:
        deadline = time.monotonic() + 240
        while True:
            with session_scope(url) as s:
                run = s.get(EvalRun, "evalrun-faults")
                assert run is not None
                status, counts = run.status, run.result_counts
            if status == "completed":
                break
            assert time.monotonic() < deadline, (status, log.read_text()[-3000:])
            time.sleep(0.3)
    finally:
        stop_process(ctl)
    after = written()
    assert sorted(after) == list(range(n))  # none lost; the unique index: none twice
    assert {i: after[i] for i in before} == before  # the first leader's rows kept
    assert counts == {"total": n, "passed": n // 2, "failed": n // 2, "errored": 0}


def test_a_full_disk_at_a_checkpoint_fails_the_job_clearly_and_keeps_the_one_before(
    platform: dict[str, Any],
) -> None:
    """The disk fills up half-way through the checkpoint of step 2 (``ENOSPC`` injected at
    the write of its optimizer file): the job fails at once (a retry would find the same
    disk) with an error that says so and how to fix it, and the checkpoint of step 1 is
    whole."""
    (job_id,) = _jobs(platform, {"hooli": 1})
    ctl, log = _controller(platform, failpoint="checkpoint.disk_full@2")
    try:
        _wait_terminal(platform, [job_id], [ctl])
    finally:
        stop_process(ctl)
    with session_scope(platform["url"]) as s:
        job = s.get(Job, job_id)
        assert job is not None and job.status == "failed", log.read_text()[-3000:]
        error = job.error
    assert error is not None and error["code"] == "disk_full", error
    assert "no space left on the device" in error["message"]
    assert "checkpoint of step 2" in error["message"]
    assert "(step 1) is intact" in error["message"] and "Free space" in error["message"]
    assert _ray_runs(platform)[job_id] == [f"{job_id}-1"]  # not retried

    folder = ArtifactStore(platform["dir"] / "artifacts").path(f"checkpoints/{job_id}")
    kept = sorted(p.name for p in folder.glob("step-*"))
    assert kept == ["step-00000001"], kept
    from safetensors.torch import load_file

    one = folder / "step-00000001"
    assert load_file(str(one / "optimizer.safetensors"))  # whole: it loads
    assert json.loads((one / "trainer_state.json").read_text())["step"] == 1
    assert any((one / "adapter").iterdir())
    with session_scope(platform["url"]) as s:
        steps = [c.step for c in s.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id))]
    assert steps == [1]
