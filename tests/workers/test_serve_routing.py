"""Two serving replicas, eight adapters, on the session's Ray cluster, deployed as the
controller deploys them (``RayBackend.deploy_model_server``): Serve's multiplexed routing
sends an adapter's requests to the replica that loaded it, so with TuneFleet's path (the
API's headers: the secret and ``serve_multiplexed_model_id``) each adapter is loaded once
in the fleet and its repeated requests land there. Where each request landed is read
from the replicas' own request counts (what they report to the controller's pushes)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import TINY
from raycluster import free_port
from tinyllm import save_random_lora
from tunefleet.platform.artifacts import ArtifactStore
from tunefleet.platform.serving_contract import (
    ADAPTER_HEADER,
    NODE_ROLE_LABEL,
    SECRET_HEADER,
    app_name,
)
from tunefleet.platform.settings import Settings

pytestmark = pytest.mark.slow

ADAPTERS = [f"ftjob-route{i}" for i in range(8)]
TRAINING = {NODE_ROLE_LABEL: "training"}


def test_two_replicas_keep_each_adapters_requests_where_it_is_loaded(
    ray_cluster: Any, tiny_registry: Path, tmp_path: Path
) -> None:
    import ray
    from ray import serve
    from transformers import AutoModelForCausalLM

    from tunefleet.workers.backend import RayBackend

    store = ArtifactStore(tmp_path / "artifacts")
    base = AutoModelForCausalLM.from_pretrained(tiny_registry / TINY)
    for i, adapter_id in enumerate(ADAPTERS):
        save_random_lora(base, store.path(store.adapter_key(adapter_id)), seed=i)
    settings = Settings(
        data_dir=tmp_path / "data",
        artifact_root=str(store.root),
        model_registry=tiny_registry,
        ray_address=ray_cluster.address,
        serve_port=free_port(),
        serve_secret="routing-test-secret",
        serve_min_replicas=2,
        serve_max_replicas=2,
    )
    ray.init(address=ray_cluster.address, log_to_driver=False)
    try:
        backend = RayBackend(settings)
        prefix = backend.deploy_model_server(TINY, str(tiny_registry / TINY))
        handle = serve.get_deployment_handle("LoraServer", app_name(TINY))
        url = f"http://127.0.0.1:{settings.serve_port}{prefix}/v1/chat/completions"

        def ask(adapter_id: str) -> None:
            answer = httpx.post(
                url,
                headers={SECRET_HEADER: settings.serve_secret, ADAPTER_HEADER: adapter_id},
                json={
                    "model": adapter_id,
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2,
                },
                timeout=120,
            )
            assert answer.status_code == 200, answer.text

        def per_replica() -> list[dict[str, Any]]:
            """Each replica's requests per adapter since the last call, and its loaded
            adapters."""
            counts = handle.broadcast("configure", {}).results(timeout_s=60)
            listings = handle.broadcast("list_adapters").results(timeout_s=60)
            assert len(counts) == len(listings) == 2, (counts, listings)
            return [
                {"uses": c["uses"], "loaded": {e["id"] for e in listing["data"]}}
                for c, listing in zip(counts, listings, strict=True)
            ]

        for adapter_id in ADAPTERS:  # each one's first request loads it somewhere
            ask(adapter_id)
        time.sleep(1.0)  # the replicas tell Serve's router what they hold every 0.1 s
        first = per_replica()
        # loaded once in the fleet, on the replica that answered its first request
        assert sorted(a for r in first for a in r["loaded"]) == ADAPTERS, first
        assert all(set(r["uses"]) == r["loaded"] for r in first), first
        assert all(r["loaded"] for r in first), first  # new adapters go to the emptier one

        for _ in range(4):  # then repeatedly, interleaved
            for adapter_id in ADAPTERS:
                ask(adapter_id)
        then = per_replica()
        for before, after in zip(first, then, strict=True):
            assert after["loaded"] == before["loaded"], (first, then)  # no second copy
            assert after["uses"] == {a: 4 for a in before["loaded"]}, (first, then)
    finally:
        serve.shutdown()  # the cluster is the session's
        ray.shutdown()


def test_a_replica_that_fits_no_node_is_refused_before_its_application_is_deployed(
    ray_cluster: Any, tiny_registry: Path, tmp_path: Path
) -> None:
    """A replica reserves its weights plus its adapter memory in Ray's memory resource:
    with more adapter memory than any node of the cluster has or can add (a GPU group
    large enough is for training only, the other too small), Ray would keep it pending
    for ever. The deploy is refused first, naming the ask, the largest node and the fix,
    and no application is deployed."""
    import ray
    from ray import serve

    from tunefleet.platform.planner import fmt_bytes
    from tunefleet.workers.backend import RayBackend, ReplicaDoesNotFit
    from tunefleet.workers.serve.app import weights_bytes

    settings = Settings(
        data_dir=tmp_path / "data",
        artifact_root=str(tmp_path / "artifacts"),
        model_registry=tiny_registry,
        ray_address=ray_cluster.address,
        serve_port=free_port(),
        serve_secret="fit-test-secret",
        serve_adapter_memory="1024Ti",
        node_types=(
            {"name": "gpu", "cpus": 8, "gpus": 1, "memory": "4096Ti", "labels": TRAINING},
            {"name": "small", "cpus": 2, "memory": "1Gi"},
        ),
    )
    ray.init(address=ray_cluster.address, log_to_driver=False)
    try:
        backend = RayBackend(settings)
        nodes = backend.nodes()
        assert nodes and all(n.memory for n in nodes)
        assert [(t.name, t.memory, t.labels) for t in backend.node_types()] == [
            ("gpu", 4096 << 40, TRAINING),
            ("small", 1 << 30, {}),
        ]
        largest = max(nodes, key=lambda n: n.memory or 0)
        assert (largest.memory or 0) > 1 << 30
        with pytest.raises(ReplicaDoesNotFit) as refused:
            backend.deploy_model_server(TINY, str(tiny_registry / TINY))
        why = str(refused.value)
        weights = weights_bytes(str(tiny_registry / TINY))
        assert f"reserves {fmt_bytes(weights + (1 << 50))} of Ray memory" in why, why
        assert f"live node {largest.id}, has {fmt_bytes(largest.memory or 0)}" in why, why
        assert "lower the adapter memory to at most" in why, why
        assert app_name(TINY) not in serve.status().applications
    finally:
        serve.shutdown()  # the cluster is the session's
        ray.shutdown()
