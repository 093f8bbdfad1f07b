"""The controller's passes against an in-process twin of the Ray backend (the real one is
exercised by tests/e2e): admission counts tokens, dispatch writes before it submits, and a
cancel that races a pass is respected, not overwritten."""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import replace
from typing import Any

import pytest
from sqlalchemy import select

from conftest import add_chat_file
from tunefleet.platform.artifacts import ArtifactStore
from tunefleet.platform.db import Adapter, File, Job, session_scope
from tunefleet.platform.jobs import JobCreateRequest, create_job, list_events
from tunefleet.platform.lease import Lease, LeaseLost
from tunefleet.platform.models import ModelRegistry
from tunefleet.platform.scheduler import Node, NodeType
from tunefleet.platform.settings import Settings
from tunefleet.platform.status import JobStatus, transition
from tunefleet.platform.tenants import authenticate, create_key, create_tenant
from tunefleet.workers import _capacity
from tunefleet.workers._admission import Admission
from tunefleet.workers._run_channel import RunChannel
from tunefleet.workers.backend import NOT_FOUND, SUCCEEDED, RunInfo
from tunefleet.workers.controller import Controller


class TwinBackend:
    """Records submissions; answers run status from a dict; can run a hook on a status
    query to stage a race."""

    def __init__(self) -> None:
        self.submitted: list[str] = []
        self.status: dict[str, str] = {}
        self.on_status: Any = None
        self.deployed: list[str] = []
        self.refuse_submits = 0  # the next n submits fail as Ray's Jobs API can
        self.channels: dict[str, RunChannel] = {}  # run id -> its channel, in-process
        self.pushed: list[tuple[str, dict[str, list[str]]]] = []
        self.node_ids = ["twin"]  # the cluster's live nodes
        self.more_nodes: list[Node] = []  # live nodes of other shapes
        self.types: list[NodeType] = []  # the node types it can add
        self.draining: dict[str, float] = {}  # node id -> drain deadline
        self.requests: list[list[dict[str, float]]] = []  # asked of the autoscaler

    def submit_run(self, sid: str, job_id: str, env: dict[str, str]) -> None:
        if self.refuse_submits:
            self.refuse_submits -= 1
            raise RuntimeError("No available agent to submit job, please try again later.")
        self.submitted.append(sid)
        self.status[sid] = "RUNNING"

    def run_status(self, sid: str) -> RunInfo:
        if self.on_status:
            self.on_status(sid)
        return RunInfo(self.status.get(sid, NOT_FOUND))

    def run_logs_tail(self, sid: str, lines: int = 20) -> str:
        return ""

    def stop_run(self, sid: str) -> None:
        self.status[sid] = "STOPPED"

    def nodes(self) -> list[Node]:
        return [Node(node_id, cpus=1) for node_id in self.node_ids] + self.more_nodes

    def node_types(self) -> list[NodeType]:
        return self.types

    def draining_nodes(self) -> dict[str, float]:
        return self.draining

    def request_capacity(self, bundles: list[dict[str, float]]) -> None:
        self.requests.append(bundles)

    def deploy_model_server(self, base_model: str, model_path: str) -> str:
        self.deployed.append(base_model)
        return f"/models/{base_model}"

    def push_serving_config(self, base_model: str, config: dict[str, list[str]]) -> list[Any]:
        self.pushed.append((base_model, config))
        return [config]

    def open_channel(self, sid: str, inputs: dict[str, Any]) -> None:
        self.channels.setdefault(sid, RunChannel(inputs))

    def open_channels(self) -> list[str]:
        return list(self.channels)

    def take(self, sid: str) -> list[dict[str, Any]] | None:
        channel = self.channels.get(sid)
        return None if channel is None else channel.take()

    def ack(self, sid: str, upto: int) -> None:
        self.channels[sid].ack(upto)

    def ask_stop(self, sid: str, stop: dict[str, Any] | None) -> None:
        self.channels[sid].ask_stop(stop)

    def close_channel(self, sid: str) -> None:
        self.channels.pop(sid, None)


@pytest.fixture(autouse=True)
def _admission_within_the_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests read a job's state after one pass, so a pass waits for its admission
    counts however long they take: a fresh controller's first count loads the model's
    tokenizer, which under a loaded CI machine can outlast the 2 s a real pass waits
    before moving on (the test of that wait sets its own, on its controller)."""
    monkeypatch.setattr(Admission, "ADMISSION_WAIT_S", 120.0)


def _job(
    settings: Settings, tenant_name: str = "acme", file_id: str = "file-1", **request: Any
) -> str:
    url = settings.resolved_database_url
    store = ArtifactStore(settings.resolved_artifact_root)
    with session_scope(url) as s:
        tenant = create_tenant(s, tenant_name)
        _, key = create_key(s, tenant.id)
        add_chat_file(s, store, tenant.id, file_id, copies=3)
        principal = authenticate(s, f"Bearer {key}")
        req = JobCreateRequest.model_validate(
            {"model": "tiny-llama", "training_file": file_id, **request}
        )
        return create_job(s, principal, req, ModelRegistry(settings.resolved_model_registry)).id


def test_admit_dispatch_and_a_cancel_racing_success(settings: Settings) -> None:
    twin = TwinBackend()
    ctl = Controller(settings, twin)  # type: ignore[arg-type]
    job_id = _job(settings)
    url = settings.resolved_database_url

    ctl.tick()  # admit (counts tokens with the model's tokenizer) and dispatch
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        assert job is not None and job.status == "running"
        assert job.stats is not None and job.stats["training_file"]["examples"] == 3
        assert job.stats["training_file"]["trained_tokens"] > 0
    assert twin.submitted == [f"{job_id}-1"]

    # the run succeeds, but the user cancels just as the controller looks
    store = ArtifactStore(settings.resolved_artifact_root)
    (store.path(store.adapter_key(job_id))).mkdir(parents=True)
    twin.status[f"{job_id}-1"] = SUCCEEDED

    def cancel(_: str) -> None:
        with session_scope(url) as s:
            transition(s, job_id, JobStatus.RUNNING, JobStatus.CANCELLED, "cancelled")
        twin.on_status = None

    twin.on_status = cancel
    ctl.tick()  # must not raise, must not overwrite the cancel
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        assert job is not None and job.status == "cancelled" and job.result_files == []
        assert list(s.scalars(select(Adapter))) == []
        assert list(s.scalars(select(File).where(File.purpose == "fine-tune-results"))) == []
    assert list(store.path("files").glob("*.csv")) == []  # written, then taken back


def test_a_succeeded_job_has_its_step_metrics_as_a_results_file(settings: Settings) -> None:
    """OpenAI's ``result_files``: the job succeeds naming a file of its tenant, purpose
    fine-tune-results, holding a row per step of what its run reported."""
    twin = TwinBackend()
    ctl = Controller(settings, twin)  # type: ignore[arg-type]
    job_id = _job(settings)
    url = settings.resolved_database_url
    ctl.tick()
    sid = f"{job_id}-1"
    for step, metrics in [
        (1, {"train_loss": 2.5, "train_mean_token_accuracy": 0.25}),
        (2, {"train_loss": 1.5, "train_mean_token_accuracy": 0.5, "valid_loss": 1.75,
             "valid_mean_token_accuracy": 0.375}),
    ]:  # fmt: skip
        twin.channels[sid].post(
            [{"kind": "metrics", "step": step, "total_steps": 2, "metrics": metrics,
              "trained_tokens": 10 * step, "eta_s": None}]
        )  # fmt: skip
    store = ArtifactStore(settings.resolved_artifact_root)
    store.path(store.adapter_key(job_id)).mkdir(parents=True)
    twin.status[sid] = SUCCEEDED
    ctl.tick()
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        assert job is not None and job.status == "succeeded"
        assert len(job.result_files) == 1
        results = s.get(File, job.result_files[0])
    assert results is not None and results.tenant_id == job.tenant_id
    assert (results.purpose, results.filename, results.status, results.format) == (
        "fine-tune-results",
        "step_metrics.csv",
        "processed",
        "csv",
    )
    assert results.path == store.results_key(results.id)
    content = b"".join(store.read_chunks(results.path))
    assert results.bytes == len(content)
    assert content.decode() == (
        "step,train_loss,train_accuracy,valid_loss,valid_mean_token_accuracy\n"
        "1,2.5,0.25,,\n"
        "2,1.5,0.5,1.75,0.375\n"
    )


def test_a_run_whose_node_left_is_stopped_and_the_job_goes_on_elsewhere(
    settings: Settings,
) -> None:
    twin = TwinBackend()
    ctl = Controller(settings, twin)  # type: ignore[arg-type]
    job_id = _job(settings)
    ctl.tick()
    assert twin.submitted == [f"{job_id}-1"]

    twin.node_ids = ["twin-2"]  # "twin" is lost; a replacement node joined
    ctl.tick()  # the run is stopped, the job queued again and placed on the new node
    assert twin.status[f"{job_id}-1"] == "STOPPED"
    assert twin.submitted == [f"{job_id}-1", f"{job_id}-2"]
    url = settings.resolved_database_url
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        assert job is not None and job.status == "running" and job.failures == 0
        assert job.placement == {"nodes": ["twin-2"]}
        events = [e.message for e in list_events(s, job_id, limit=50)[0]]
    assert any(m.startswith("Node(s) twin left the Ray cluster") for m in events), events


ACCELERATED = {"resources": {"custom_resources_per_worker": {"accelerator": 1}}}


def test_a_job_for_a_node_type_at_zero_waits_for_it_and_starts_when_it_comes(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The controller asks Ray's autoscaler for the waiting job's gang beside the running
    workers, says so on the job with the time it asked, and once the job is dispatched
    holds its workers as running ones: the request was withdrawn then, and the autoscaler
    took the new node back as idle before Ray placed the run (a CI run of the elastic
    test)."""
    twin = TwinBackend()
    twin.types = [NodeType("accel", cpus=1, resources={"accelerator": 1}, max_count=2)]
    ctl = Controller(settings, twin)  # type: ignore[arg-type]
    plain = _job(settings)
    ctl.tick()  # the plain job runs on "twin"
    job_id = _job(settings, "globex", "file-2", tunefleet=ACCELERATED)
    ctl.tick()
    ctl.tick()  # asked once, not again while nothing changes
    # the plain job's worker from the pass that dispatched it
    assert twin.requests == [[{"CPU": 1}], [{"CPU": 1, "accelerator": 1}, {"CPU": 1}]]
    url = settings.resolved_database_url
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        assert job is not None and job.status == "queued"
        (event,) = [e for e in list_events(s, job_id, limit=50)[0] if "autoscaler" in e.message]
    assert event.message.startswith(
        "Waiting in queue at position 1: waiting for the autoscaler to add 1 node(s) of "
        "group accel (requested at "
    )
    assert event.data is not None and event.data["capacity_request"]["nodes"] == {"accel": 1}

    twin.more_nodes = [Node("accel-1", cpus=1, resources={"accelerator": 1})]
    twin.types = [replace(twin.types[0], live=1)]
    ctl.tick()
    assert twin.submitted == [f"{plain}-1", f"{job_id}-1"]
    assert twin.requests[-1] == [{"CPU": 1}, {"CPU": 1, "accelerator": 1}]  # held, running
    ctl.tick()  # and held while they run with no job queued
    assert twin.requests[-1] == [{"CPU": 1}, {"CPU": 1, "accelerator": 1}]
    # sent again unchanged once REASSERT_S has passed: a request something else on the
    # cluster sent in its place is repaired
    sent = len(twin.requests)
    monkeypatch.setattr(_capacity, "REASSERT_S", 0.0)
    ctl.tick()
    assert twin.requests[sent:] == [[{"CPU": 1}, {"CPU": 1, "accelerator": 1}]]
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        assert job is not None and job.placement == {"nodes": ["accel-1"]}


def test_a_job_that_waits_for_nodes_too_long_fails_saying_what_to_check(
    settings: Settings,
) -> None:
    twin = TwinBackend()
    twin.types = [NodeType("accel", cpus=1, resources={"accelerator": 1}, max_count=2)]
    ctl = Controller(settings.model_copy(update={"capacity_wait_s": 0.5}), twin)  # type: ignore[arg-type]
    job_id = _job(settings, tunefleet=ACCELERATED)
    ctl.tick()
    time.sleep(0.6)
    ctl.tick()
    with session_scope(settings.resolved_database_url) as s:
        job = s.get(Job, job_id)
        assert job is not None and job.status == "failed" and job.error is not None
    assert job.error["code"] == "capacity_timeout"
    assert "longer than the 0 s allowed (TUNEFLEET_CAPACITY_WAIT_S)" in job.error["message"]
    assert "maxReplicas" in job.error["message"]
    assert twin.requests[-1] == []


def test_a_job_whose_node_is_drained_checkpoints_and_resumes_elsewhere_without_a_retry(
    settings: Settings,
) -> None:
    twin = TwinBackend()
    ctl = Controller(settings, twin)  # type: ignore[arg-type]
    job_id = _job(settings)
    url = settings.resolved_database_url
    ctl.tick()
    sid = f"{job_id}-1"
    channel = twin.channels[sid]
    twin.node_ids = ["twin", "twin-2"]
    twin.draining = {"twin": time.time() + 60}
    ctl.tick()  # queued again
    ctl.tick()  # the run is told to checkpoint and leave, as on a pause
    stop, _ = channel.post([{"kind": "checkpoint", "step": 3, "path": "x", "metrics": {}}])
    assert stop is not None and stop["stop"] == "paused"
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        assert job is not None and job.status == "queued" and job.failures == 0
    assert twin.submitted == [sid]  # the run has not left yet: nothing new starts
    twin.status[sid] = "SUCCEEDED"  # it checkpointed and left
    ctl.tick()
    assert twin.submitted == [sid, f"{job_id}-2"]
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        assert job is not None and job.status == "running" and job.failures == 0
        assert job.placement == {"nodes": ["twin-2"]}  # not the draining node
        events = [e.message for e in list_events(s, job_id, limit=50)[0]]
    drained = re.compile(r"Node\(s\) twin \(deadline in (59|60) s\) are being drained")
    assert any(drained.match(m) for m in events), events
    assert "Checkpoint saved at step 3" in events
    assert any(m.endswith("it resumes from the checkpoint at step 3") for m in events), events


def test_runs_report_through_their_channel_and_learn_to_stop_from_it(
    settings: Settings,
) -> None:
    """A run's records reach its job through the controller (once each, even when a
    fail-over takes them again), the run learns of a pause from its channel, and the
    channel closes once the run has ended and said everything."""
    twin = TwinBackend()
    ctl = Controller(settings, twin)  # type: ignore[arg-type]
    job_id = _job(settings)
    url = settings.resolved_database_url
    ctl.tick()
    sid = f"{job_id}-1"
    channel = twin.channels[sid]
    assert channel.inputs()["spec"]["job_id"] == job_id  # the run reads no database
    assert channel.post([{"kind": "message", "message": "Training 4 steps"}]) == (None, 1)
    twin.ack = lambda sid, upto: None  # type: ignore[method-assign]  # a fail-over: unacked
    ctl.tick()
    ctl.tick()
    del twin.ack  # back to the class's
    with session_scope(url) as s:
        transition(s, job_id, JobStatus.RUNNING, JobStatus.PAUSED, "Paused by the user")
    ctl.tick()
    stop, _ = channel.post([{"kind": "message", "message": "Paused at step 2"}])
    assert stop == {"stop": "paused", "status": "paused", "current": sid}
    assert channel.acked() == 1  # what the controller wrote (a run's flush waits for it)
    twin.status[sid] = "STOPPED"  # the run checkpointed and left
    ctl.tick()
    assert sid not in twin.channels
    with session_scope(url) as s:
        events = [e.message for e in list_events(s, job_id, limit=100)[0]]
    assert events.count("Training 4 steps") == 1 and "Paused at step 2" in events


def test_a_lost_submission_is_submitted_again_under_the_same_id(settings: Settings) -> None:
    twin = TwinBackend()
    ctl = Controller(settings, twin)  # type: ignore[arg-type]
    job_id = _job(settings)
    ctl.tick()
    twin.status.clear()  # as if the process died between the commit and the submit
    ctl.tick()
    assert twin.submitted == [f"{job_id}-1", f"{job_id}-1"]


def test_a_failed_run_is_retried_with_backoff_then_the_job_fails(settings: Settings) -> None:
    twin = TwinBackend()
    ctl = Controller(settings, twin)  # type: ignore[arg-type]
    job_id = _job(settings)
    url = settings.resolved_database_url
    ctl.tick()
    for failure in (1, 2):
        twin.status[f"{job_id}-{failure}"] = "FAILED"
        ctl.tick()  # requeued with a backoff; not started again yet
        with session_scope(url) as s:
            job = s.get(Job, job_id)
            assert job is not None and job.status == "queued" and job.failures == failure
            assert job.not_before is not None and job.not_before > time.time()
            job.not_before = 0  # the backoff has passed
        assert twin.submitted[-1] == f"{job_id}-{failure}"
        ctl.tick()
        assert twin.submitted[-1] == f"{job_id}-{failure + 1}"  # the next run
    twin.status[f"{job_id}-3"] = "FAILED"
    ctl.tick()
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        assert job is not None and job.status == "failed" and job.failures == 2
        messages = [e.message for e in list_events(s, job_id, limit=100)[0]]
    assert sum("retrying from the newest checkpoint in" in m for m in messages) == 2
    assert any("in 10s (failure 1 of 3)" in m for m in messages)
    assert any("in 20s (failure 2 of 3)" in m for m in messages)


def test_a_job_larger_than_the_cluster_fails_with_what_the_cluster_has(
    settings: Settings,
) -> None:
    twin = TwinBackend()
    ctl = Controller(settings, twin)  # type: ignore[arg-type]
    job_id = _job(settings, tunefleet={"resources": {"num_workers": 2}})
    ctl.tick()
    with session_scope(settings.resolved_database_url) as s:
        job = s.get(Job, job_id)
        assert job is not None and job.status == "failed"
        assert job.error is not None and job.error["code"] == "does_not_fit_cluster"
        assert "largest node live node twin with 1 CPU" in job.error["message"]
    assert twin.submitted == []


def test_a_refused_submit_is_retried_after_a_backoff(settings: Settings) -> None:
    twin = TwinBackend()
    ctl = Controller(settings, twin)  # type: ignore[arg-type]
    url = settings.resolved_database_url
    job_id = _job(settings)
    twin.refuse_submits = 1  # Ray's job agent is not up yet
    ctl.tick()
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        assert job is not None and job.status == "queued" and job.failures == 1
        assert job.not_before is not None
        job.not_before = 0
    ctl.tick()
    assert twin.submitted == [f"{job_id}-2"]  # the next attempt went through


def test_a_submit_that_raised_but_was_taken_keeps_its_channel_and_stops_cleanly(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ray's Jobs API can answer a submit with an error (its head timing out on its agent)
    and start the run anyway, a moment later. While Ray does not know the run, its channel
    stays open (``UNKNOWN_RUN_GRACE_S``): the run, once started, reports through it and
    learns to leave (its job moved on), instead of failing on a closed channel."""
    from tunefleet.workers import controller as controller_module

    twin = TwinBackend()
    ctl = Controller(settings, twin)  # type: ignore[arg-type]
    job_id = _job(settings)
    sid = f"{job_id}-1"
    twin.refuse_submits = 1
    ctl.tick()  # dispatched, the submit raised: queued with a backoff
    for _ in range(3):
        ctl.tick()  # Ray does not know the run yet
    assert sid in twin.channels
    twin.status[sid] = "RUNNING"  # the submit was taken after all
    twin.channels[sid].post([{"kind": "message", "message": "hello"}])
    ctl.tick()
    stop, _ = twin.channels[sid].post([])
    assert stop is not None and stop["stop"] == "paused"  # not its job's run: leave
    twin.status[sid] = "SUCCEEDED"  # it left
    ctl.tick()
    assert sid not in twin.channels  # closed once Ray says it ended
    with session_scope(settings.resolved_database_url) as s:
        assert "hello" in [e.message for e in list_events(s, job_id, limit=100)[0]]

    # a run Ray never takes: its channel is closed once the grace has passed
    with session_scope(settings.resolved_database_url) as s:
        job = s.get(Job, job_id)
        assert job is not None and job.status == "queued"
        job.not_before = 0
    twin.refuse_submits = 1
    ctl.tick()
    sid = f"{job_id}-2"
    ctl.tick()
    assert sid in twin.channels
    monkeypatch.setattr(controller_module, "UNKNOWN_RUN_GRACE_S", 0.0)
    ctl.tick()
    assert sid not in twin.channels


def test_a_submit_refused_every_time_fails_the_job(settings: Settings) -> None:
    twin = TwinBackend()
    ctl = Controller(settings, twin)  # type: ignore[arg-type]
    url = settings.resolved_database_url
    other = _job(settings)
    twin.refuse_submits = 100  # Ray keeps refusing
    for _ in range(3):
        ctl.tick()
        with session_scope(url) as s:
            job = s.get(Job, other)
            assert job is not None
            if job.status == "queued":
                job.not_before = 0
    with session_scope(url) as s:
        job = s.get(Job, other)
        assert job is not None and job.status == "failed" and job.failures == 3
        assert job.error is not None and job.error["code"] == "dispatch_failed"
        assert "No available agent" in job.error["message"]


def _jobs(settings: Settings, n: int, tenant_name: str = "globex") -> list[str]:
    """``n`` jobs of one tenant on one file."""
    url = settings.resolved_database_url
    with session_scope(url) as s:
        tenant = create_tenant(s, tenant_name)
        principal = authenticate(s, f"Bearer {create_key(s, tenant.id)[1]}")
        add_chat_file(s, ArtifactStore(settings.resolved_artifact_root), tenant.id, "file-g", 3)
        registry = ModelRegistry(settings.resolved_model_registry)
        req = JobCreateRequest.model_validate({"model": "tiny-llama", "training_file": "file-g"})
        return [create_job(s, principal, req, registry).id for _ in range(n)]


def _store_spec_value(url: str, job_id: str, cpus: Any) -> None:
    """Write into a stored spec what an earlier version let through: Infinity, which the
    JSON column stores as null."""
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        assert job is not None
        spec = json.loads(json.dumps(job.spec))
        spec["tunefleet"]["resources"]["cpus_per_worker"] = cpus
        job.spec = spec


def test_a_stored_spec_that_no_longer_validates_fails_that_job_alone(settings: Settings) -> None:
    """Such a spec stopped every pass (every tenant's jobs stayed where they were); now its
    job fails with the reason, whether it waits for admission or in the queue, and the other
    jobs go on in the same pass."""
    twin = TwinBackend()
    ctl = Controller(settings, twin)  # type: ignore[arg-type]
    url = settings.resolved_database_url
    bad, good, later = _jobs(settings, 3)
    _store_spec_value(url, bad, None)
    ctl.tick()
    with session_scope(url) as s:
        failed, running, queued = (s.get(Job, j) for j in (bad, good, later))
        assert failed is not None and failed.status == "failed"
        assert failed.error is not None and failed.error["code"] == "invalid_spec"
        assert "resources.cpus_per_worker" in failed.error["message"]
        assert running is not None and running.status == "running"
        assert queued is not None and queued.status == "queued"  # one CPU, taken
    assert twin.submitted == [f"{good}-1"]

    _store_spec_value(url, later, 1e9)  # over the bound, in the queue
    twin.status[f"{good}-1"] = "FAILED"  # and another job needs handling in the same pass
    ctl.tick()
    with session_scope(url) as s:
        failed, retried = s.get(Job, later), s.get(Job, good)
        assert failed is not None and failed.status == "failed"
        assert failed.error is not None and failed.error["code"] == "invalid_spec"
        assert retried is not None and retried.status == "queued" and retried.failures == 1


class ServeRefusingTwin(TwinBackend):
    def deploy_model_server(self, base_model: str, model_path: str) -> str:
        self.deployed.append(base_model)
        raise RuntimeError("replica failed to start: out of memory")


def test_a_model_server_that_will_not_start_troubles_its_job_alone(settings: Settings) -> None:
    """A base model whose Serve application does not start failed every pass; now the job
    whose adapter waits for it says why, once, and stays running (its adapter is kept) while
    the deploy is retried after a while; other jobs are followed in the same pass."""
    twin = ServeRefusingTwin()
    twin.nodes = lambda: [Node("twin", cpus=2)]  # type: ignore[method-assign]
    ctl = Controller(settings, twin)  # type: ignore[arg-type]
    url = settings.resolved_database_url
    done, failing = _jobs(settings, 2)
    ctl.tick()
    assert twin.submitted == [f"{done}-1", f"{failing}-1"]
    store = ArtifactStore(settings.resolved_artifact_root)
    store.path(store.adapter_key(done)).mkdir(parents=True)
    twin.status[f"{done}-1"] = SUCCEEDED
    twin.status[f"{failing}-1"] = "FAILED"
    ctl.tick()
    ctl.tick()
    with session_scope(url) as s:
        waiting, retried = s.get(Job, done), s.get(Job, failing)
        assert waiting is not None and waiting.status == "running"
        assert retried is not None and retried.status == "queued" and retried.failures == 1
        events, _ = list_events(s, done, limit=100)
    said = [e for e in events if "could not follow this job" in e.message]
    assert len(said) == 1 and said[0].level == "warn"
    assert "serving base model 'tiny-llama' failed to start" in said[0].message
    assert "out of memory" in said[0].message
    assert twin.deployed == ["tiny-llama"]  # not again on every pass
    assert store.exists(store.adapter_key(done))


class ServeFailingOnceTwin(TwinBackend):
    """A model server whose first deploy fails (a replica out of memory); later ones start."""

    def deploy_model_server(self, base_model: str, model_path: str) -> str:
        self.deployed.append(base_model)
        if len(self.deployed) == 1:
            raise RuntimeError("replica failed to start: out of memory")
        return f"/models/{base_model}"


class Clock:
    """The serving module's ``time``, its monotonic clock moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return time.time()


def test_a_failed_model_server_deploy_is_retried_after_60_s(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/reliability.md: a failed Serve deploy is retried after 60 s, not on the passes
    before it (its job says why once, and waits), and the job succeeds once it starts."""
    from tunefleet.workers import _serving

    clock = Clock()
    monkeypatch.setattr(_serving, "time", clock)
    twin = ServeFailingOnceTwin()
    ctl = Controller(settings, twin)  # type: ignore[arg-type]
    url = settings.resolved_database_url
    job_id = _job(settings)
    deadline = time.monotonic() + 60  # the first count loads the tokenizer: let it finish
    while twin.submitted != [f"{job_id}-1"]:
        assert time.monotonic() < deadline, twin.submitted
        ctl.tick()
    store = ArtifactStore(settings.resolved_artifact_root)
    store.path(store.adapter_key(job_id)).mkdir(parents=True)
    twin.status[f"{job_id}-1"] = SUCCEEDED

    def status_and_said() -> tuple[str, list[str]]:
        with session_scope(url) as s:
            job = s.get(Job, job_id)
            assert job is not None
            events, _ = list_events(s, job_id, limit=100)
        return job.status, [e.message for e in events if "failed to start" in e.message]

    ctl.tick()  # the run succeeded; its model's server fails to start
    status, said = status_and_said()
    assert twin.deployed == ["tiny-llama"] and status == "running"
    assert len(said) == 1 and "out of memory" in said[0] and "retrying in 60s" in said[0]
    for passed in (1.0, 30.0, 59.9):  # passes before the 60 s are up: no deploy
        clock.now = 1000.0 + passed
        ctl.tick()
        assert twin.deployed == ["tiny-llama"], passed
        assert status_and_said() == (status, said)  # still waiting, said once
    clock.now = 1000.0 + 60.1
    ctl.tick()  # the first pass after: deployed again, and it starts
    assert twin.deployed == ["tiny-llama", "tiny-llama"]
    assert status_and_said() == ("succeeded", said)


class LoggingTwin(TwinBackend):
    """Answers a failed run as Ray does: its message carries the run's last log lines."""

    LOGS = 'Traceback (most recent call last):\n  File "/srv/secret/train.py"\nAWS_SECRET=abc'

    def run_status(self, sid: str) -> RunInfo:
        info = super().run_status(sid)
        if info.status != "FAILED":
            return info
        return RunInfo(
            "FAILED",
            "Job entrypoint command failed with exit code 1, last available logs "
            f"(truncated to 20,000 chars):\n{self.LOGS}",
        )

    def run_logs_tail(self, sid: str, lines: int = 20) -> str:
        return self.LOGS


def test_ray_log_lines_never_reach_the_tenant(settings: Settings) -> None:
    """A run that failed without recording why put Ray's log tail (paths, environment,
    secrets a library printed) into the tenant's retry events and job error; they say what
    Ray says less the logs, and where the operator reads them."""
    twin = LoggingTwin()
    ctl = Controller(settings, twin)  # type: ignore[arg-type]
    url = settings.resolved_database_url
    job_id = _job(settings)
    ctl.tick()
    for attempt in (1, 2, 3):
        twin.status[f"{job_id}-{attempt}"] = "FAILED"
        ctl.tick()
        with session_scope(url) as s:
            job = s.get(Job, job_id)
            assert job is not None
            job.not_before = 0
        ctl.tick()
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        assert job is not None and job.status == "failed" and job.error is not None
        events, _ = list_events(s, job_id, limit=100)
    said = [
        job.error["message"],
        *(e.message for e in events),
        *(json.dumps(e.data) for e in events),
    ]
    assert not any("AWS_SECRET" in m or "/srv/secret" in m for m in said), said
    assert job.error["message"] == (
        f"Job entrypoint command failed with exit code 1 (Ray job {job_id}-3; its logs are "
        "in Ray's job logs)"
    )
    assert sum("failed (Job entrypoint command failed with exit code 1)" in m for m in said) == 2


class StopRecordingTwin(TwinBackend):
    def __init__(self) -> None:
        super().__init__()
        self.stopped: list[str] = []

    def stop_run(self, sid: str) -> None:
        self.stopped.append(sid)
        super().stop_run(sid)


def test_pause_resume_races_never_run_two_runs_of_a_job_at_once(settings: Settings) -> None:
    """A pause and resume faster than the run saw the pause (the controller stops a paused
    run only after a grace period) started a second run beside the first, both writing one
    checkpoint folder. Now the next run starts only once the previous one has left (it does
    at its next step: the job is no longer running), and one stuck past the grace is
    stopped."""
    twin = StopRecordingTwin()
    ctl = Controller(settings, twin)  # type: ignore[arg-type]
    url = settings.resolved_database_url
    job_id = _job(settings)
    ctl.tick()
    first = f"{job_id}-1"
    assert twin.submitted == [first]

    def pause_and_resume() -> None:  # as the API does
        with session_scope(url) as s:
            transition(s, job_id, [JobStatus.QUEUED, JobStatus.RUNNING], JobStatus.PAUSED, "p")
        with session_scope(url) as s:
            transition(s, job_id, JobStatus.PAUSED, JobStatus.QUEUED, "r")

    for _ in range(3):  # pause -> resume -> pause -> resume ..., each pass in between
        pause_and_resume()
        ctl.tick()
        assert twin.submitted == [first]  # the first still runs: no second one
        with session_scope(url) as s:
            job = s.get(Job, job_id)
            assert job is not None and job.status == "queued"
            messages = [e.message for e in list_events(s, job_id, limit=100)[0]]
        waiting = f"its previous run (Ray job {first}) is checkpointing and stopping"
        assert sum(waiting in m for m in messages) == 1  # said once
    assert twin.stopped == []  # within the grace: it leaves by itself

    with session_scope(url) as s:  # past the grace: stopped
        job = s.get(Job, job_id)
        assert job is not None
        job.updated_at -= 1000
    ctl.tick()
    assert twin.stopped == [first] and twin.submitted == [first]
    ctl.tick()  # it has stopped: the next run starts
    assert twin.submitted == [first, f"{job_id}-2"]
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        assert job is not None and job.status == "running"
        assert job.ray_submission_id == f"{job_id}-2"


def test_a_deposed_leader_changes_nothing_its_successor_owns(settings: Settings) -> None:
    """A leader that stalled past its lease's TTL while a standby took over wakes up in
    the middle of a pass: every write it attempts is fenced by the lease term and rolled
    back, it stands by, and the successor runs the job."""
    url = settings.resolved_database_url
    now = [1000.0]
    old = Lease(url, holder="old", ttl_s=10, clock=lambda: now[0])
    new = Lease(url, holder="new", ttl_s=10, clock=lambda: now[0])
    assert old.acquire() and old.term == 1
    twin = TwinBackend()
    deposed = Controller(settings, twin, lease=old)  # type: ignore[arg-type]
    job_id = _job(settings)
    with session_scope(url) as s:
        events_before = len(list_events(s, job_id, limit=100)[0])

    now[0] += 11  # the old leader stalls past its TTL; the standby takes over
    assert new.acquire() and new.term == 2
    with pytest.raises(LeaseLost, match="term 1 was taken over"):
        deposed.tick()  # admission would move the job to queued: fenced, rolled back
    assert not old.is_leader
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        assert job is not None and job.status == "validating_files"
        assert len(list_events(s, job_id, limit=100)[0]) == events_before
    assert twin.submitted == []

    successor = Controller(settings, twin, lease=new)  # type: ignore[arg-type]
    successor.tick()
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        assert job is not None and job.status == "running"
    assert twin.submitted == [f"{job_id}-1"]


def test_counting_a_large_file_holds_up_no_pass(settings: Settings) -> None:
    """Counting tokens ran inside the pass: one tenant's large file stalled every tenant's
    dispatch and the lease's renewal. Now it runs on the admission thread; a pass waits
    for it only briefly and dispatches the queue meanwhile."""
    twin = TwinBackend()
    ctl = Controller(settings, twin)  # type: ignore[arg-type]
    url = settings.resolved_database_url
    first, second = _jobs(settings, 2, "initech")
    deadline = time.monotonic() + 60  # the first count loads the tokenizer: let it finish
    while twin.submitted != [f"{first}-1"]:
        assert time.monotonic() < deadline, twin.submitted
        ctl.tick()  # one CPU: the first runs, the second waits
    ctl.admission.ADMISSION_WAIT_S = 0.2
    twin.status[f"{first}-1"] = "FAILED"  # the first is requeued: the second can start

    release = threading.Event()
    started, held = threading.Event(), threading.Event()
    counting = ctl.admission._file_stats

    def slow(file_id: str, *args: Any) -> dict[str, int]:
        if file_id == "file-1":  # the large file, as slow as one can be
            started.set()
            release.wait(30)
            held.set()  # 30 s on, or released: a pass that waited for it ends after this
        return counting(file_id, *args)

    ctl.admission._file_stats = slow  # type: ignore[method-assign]
    large = _job(settings)
    ctl.tick()
    # no clock: the pass ended while the count it started still waits to be released
    assert started.wait(30) and not held.is_set()
    with session_scope(url) as s:
        assert s.get(Job, large).status == "validating_files"  # type: ignore[union-attr]
        assert s.get(Job, second).status == "running"  # type: ignore[union-attr]
    assert twin.submitted == [f"{first}-1", f"{second}-1"]
    release.set()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        ctl.tick()
        with session_scope(url) as s:
            if s.get(Job, large).status != "validating_files":  # type: ignore[union-attr]
                break
    with session_scope(url) as s:
        assert s.get(Job, large).status in ("queued", "running")  # type: ignore[union-attr]


def test_counting_past_its_time_limit_fails_the_job_with_the_fix(settings: Settings) -> None:
    twin = TwinBackend()
    ctl = Controller(settings, twin)  # type: ignore[arg-type]
    ctl.admission.ADMISSION_TIMEOUT_S = 0.0
    job_id = _job(settings)
    ctl.tick()
    with session_scope(settings.resolved_database_url) as s:
        job = s.get(Job, job_id)
        assert job is not None and job.status == "failed"
        assert job.error is not None and job.error["code"] == "invalid_file"
        assert "took longer than 0 s" in job.error["message"]
        assert "split the training file" in job.error["message"]


class SlowServeTwin(TwinBackend):
    """A model server whose first replica takes as long as ``release`` says (a large base
    model loading, or a replica the cluster cannot place yet)."""

    def __init__(self) -> None:
        super().__init__()
        self.release, self.held = threading.Event(), threading.Event()

    def deploy_model_server(self, base_model: str, model_path: str) -> str:
        self.deployed.append(base_model)
        self.release.wait(30)
        self.held.set()  # 30 s on, or released: a pass that waited for it ends after this
        return f"/models/{base_model}"


def test_a_slow_model_server_deploy_holds_up_no_pass(settings: Settings) -> None:
    """Deploying Serve ran inside the pass: a replica that took minutes to start (or could
    not be placed) stalled every tenant's jobs and the lease's renewal. Now it runs on the
    serving thread; the job whose adapter waits for it stays running, says so once if it
    takes long, and succeeds on the pass after the deploy ends."""
    twin = SlowServeTwin()
    twin.nodes = lambda: [Node("twin", cpus=2)]  # type: ignore[method-assign]
    ctl = Controller(settings, twin)  # type: ignore[arg-type]
    ctl.serving.SERVE_WAIT_S = 0.2
    url = settings.resolved_database_url
    done, other = _jobs(settings, 2)
    ctl.tick()
    store = ArtifactStore(settings.resolved_artifact_root)
    store.path(store.adapter_key(done)).mkdir(parents=True)
    twin.status[f"{done}-1"] = SUCCEEDED
    twin.status[f"{other}-1"] = "FAILED"
    ctl.tick()
    ctl.serving.SERVE_SLOW_S = 0.0  # from now on the deploy counts as slow
    for _ in range(3):
        ctl.tick()
        time.sleep(0.6)
    # no clock: four passes ended while the deploy the first started still waits
    assert twin.deployed == ["tiny-llama"] and not twin.held.is_set()
    with session_scope(url) as s:
        waiting, retried = s.get(Job, done), s.get(Job, other)
        assert waiting is not None and waiting.status == "running"
        assert retried is not None and retried.status == "queued"  # followed meanwhile
        events, _ = list_events(s, done, limit=100)
    slow = [e.message for e in events if "has been starting for more than" in e.message]
    assert len(slow) == 1 and "may not fit the cluster" in slow[0], slow
    twin.release.set()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        ctl.tick()
        with session_scope(url) as s:
            if s.get(Job, done).status == "succeeded":  # type: ignore[union-attr]
                break
    with session_scope(url) as s:
        assert s.get(Job, done).status == "succeeded"  # type: ignore[union-attr]
    assert twin.deployed == ["tiny-llama"]


def test_a_model_server_deploys_while_the_first_job_on_it_trains(settings: Settings) -> None:
    """Serving was deployed when the first job on a base model ended, so that job read
    succeeded a model load after its run (28 s in the elastic cluster test). Now the
    deploy starts as the run is submitted, and the job succeeds in the pass after its run
    ends; the deploy is not repeated."""
    twin = SlowServeTwin()
    twin.nodes = lambda: [Node("twin", cpus=2)]  # type: ignore[method-assign]
    ctl = Controller(settings, twin)  # type: ignore[arg-type]
    url = settings.resolved_database_url
    (job_id,) = _jobs(settings, 1)
    ctl.tick()
    assert twin.submitted == [f"{job_id}-1"]
    deadline = time.monotonic() + 10
    while twin.deployed != ["tiny-llama"]:  # on the serving thread, the run not ended
        assert time.monotonic() < deadline, "the deploy never started"
        time.sleep(0.05)
    twin.release.set()
    assert twin.held.wait(10)
    store = ArtifactStore(settings.resolved_artifact_root)
    store.path(store.adapter_key(job_id)).mkdir(parents=True)
    twin.status[f"{job_id}-1"] = SUCCEEDED
    ctl.tick()
    with session_scope(url) as s:
        assert s.get(Job, job_id).status == "succeeded"  # type: ignore[union-attr]
    assert twin.deployed == ["tiny-llama"]


class CountingTwin(TwinBackend):
    """Replicas that answer a push with the requests per adapter each one counted."""

    def __init__(self) -> None:
        super().__init__()
        self.uses: list[dict[str, int]] = []  # one per replica

    def push_serving_config(self, base_model: str, config: dict[str, list[str]]) -> list[Any]:
        self.pushed.append((base_model, config))
        return [{**config, "uses": uses} for uses in self.uses]


def test_a_starting_replica_is_told_the_adapters_most_requested_in_the_last_hour(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The controller adds up what every replica counted, over the last hour, and stores
    the busiest adapters still on record (``serve_warm_adapters`` of them, most requested
    first) with the serving configuration, where a starting replica reads them
    (``Keys.serving_key``; tests/cluster shows a replica loading them)."""
    from tunefleet.workers import _serving
    from tunefleet.workers._serving import Serving

    clock = Clock()
    monkeypatch.setattr(_serving, "time", clock)
    url = settings.resolved_database_url
    jobs = [_job(settings, t, f"file-{i}") for i, t in enumerate(("acme", "globex", "initech"))]
    with session_scope(url) as s:
        for job_id in jobs:
            job = s.get(Job, job_id)
            assert job is not None
            s.add(
                Adapter(
                    id=f"adapter-{job_id}",
                    tenant_id=job.tenant_id,
                    job_id=job_id,
                    name=f"ft:tiny-llama:{job_id}",
                    base_model="tiny-llama",
                    path=f"adapters/{job_id}",
                )
            )
    twin = CountingTwin()
    store = ArtifactStore(settings.resolved_artifact_root)
    serving = Serving(
        settings.model_copy(update={"serve_warm_adapters": 2}),
        twin,  # type: ignore[arg-type]
        ModelRegistry(settings.resolved_model_registry),
        url,
        store,
    )
    config = {"merged": [jobs[2]], "pinned": [], "prefetch": list(jobs)}

    def stored_after(*uses: dict[str, int]) -> dict[str, Any]:
        twin.uses = list(uses)
        serving._push({"tiny-llama": config})
        stored: dict[str, Any] = json.loads(store.path(store.serving_key("tiny-llama")).read_text())
        return stored

    # two replicas' counts add up; an adapter deleted meanwhile is not warmed
    stored = stored_after({jobs[0]: 1, jobs[1]: 4}, {jobs[0]: 2, jobs[2]: 1, "ftjob-gone": 9})
    assert stored == {**config, "warm": [jobs[1], jobs[0]]}
    clock.now += 3000  # 50 minutes on, the third is the busiest
    assert stored_after({jobs[2]: 10})["warm"] == [jobs[2], jobs[1]]
    clock.now += 700  # past the hour: the first push's counts are forgotten
    assert stored_after({jobs[0]: 1}, {})["warm"] == [jobs[2], jobs[0]]


class PrefetchingTwin(TwinBackend):
    """Replicas that copy an adapter when told to, once ``go`` is set, each answering as
    ``LoraServer.prefetch_now``."""

    def __init__(self, answers: list[dict[str, Any]]) -> None:
        super().__init__()
        self.answers = answers
        self.go = threading.Event()
        self.asked: list[tuple[str, str]] = []

    def prefetch_adapter(self, base_model: str, adapter_id: str, timeout_s: float) -> list[Any]:
        self.asked.append((base_model, adapter_id))
        self.go.wait(timeout_s)
        return self.answers


def test_a_succeeded_jobs_adapter_is_copied_to_the_serving_nodes_before_it_reads_succeeded(
    settings: Settings, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """With object storage, the controller has every replica of the base model copy the
    adapter to its node before the job succeeds, off the pass (``None``: not yet), for at
    most PREFETCH_WAIT_S; the job's event says whether every replica had it before, or
    which did not and when they will."""
    from s3 import new_bucket
    from tunefleet.platform.artifacts import open_store
    from tunefleet.workers import _serving
    from tunefleet.workers._serving import PREFETCH_WAIT_S, Serving

    clock = Clock()
    monkeypatch.setattr(_serving, "time", clock)
    store = open_store(new_bucket(s3_endpoint), endpoint_url=s3_endpoint, cache_dir=tmp_path)
    registry = ModelRegistry(settings.resolved_model_registry)
    url = settings.resolved_database_url

    twin = PrefetchingTwin([{"copied": True, "bytes": 10}, {"copied": True, "bytes": 0}])
    serving = Serving(settings, twin, registry, url, store)  # type: ignore[arg-type]
    assert serving.prefetch_before_success("tiny-llama", "ftjob-1") is None  # copying
    assert serving.prefetch_before_success("tiny-llama", "ftjob-1") is None
    twin.go.set()
    deadline = time.monotonic() + 10
    while (said := serving.prefetch_before_success("tiny-llama", "ftjob-1")) is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert twin.asked == [("tiny-llama", "ftjob-1")]  # once, however many passes asked
    assert said == (
        "The adapter was copied to the node cache of 2 replica(s) serving tiny-llama before "
        "the job succeeded: its first request loads from local disk",
        {"prefetched_replicas": 2, "serving_replicas": 2},
    )

    # one replica's disk is full; another copy takes longer than the wait
    twin = PrefetchingTwin([{"copied": True}, {"copied": False, "error": "OSError: disk full"}])
    twin.go.set()
    serving = Serving(settings, twin, registry, url, store)  # type: ignore[arg-type]
    while (said := serving.prefetch_before_success("tiny-llama", "ftjob-2")) is None:
        time.sleep(0.01)
    assert said[0].startswith(
        "The adapter was copied to 1 of 2 replica(s) serving tiny-llama before the job "
        "succeeded (OSError: disk full); each replica copies it within 2s of success"
    )
    twin = PrefetchingTwin([])
    serving = Serving(settings, twin, registry, url, store)  # type: ignore[arg-type]
    assert serving.prefetch_before_success("tiny-llama", "ftjob-3") is None
    clock.now += PREFETCH_WAIT_S  # the job waits no longer
    said = serving.prefetch_before_success("tiny-llama", "ftjob-3")
    assert said is not None and "(not done within 30s)" in said[0], said
    twin.go.set()

    # a local store: replicas read it in place, nothing to copy or say
    local = ArtifactStore(settings.resolved_artifact_root)
    serving = Serving(settings, TwinBackend(), registry, url, local)  # type: ignore[arg-type]
    assert serving.prefetch_before_success("tiny-llama", "ftjob-4") == ("", {})
