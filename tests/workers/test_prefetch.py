"""A Serve replica copies the adapters the controller pushes (``prefetch``) from object
storage to its node's cache ahead of any request, so a first request loads from local
disk: the load reads nothing from object storage, by the store's own byte counters. On a
real S3 server (moto's), with the replica's own method."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

from s3 import new_bucket
from tunefleet.platform.artifacts import open_store


def test_a_replica_copies_pushed_adapters_to_its_node_ahead_of_requests(
    s3_endpoint: str, tmp_path: Path
) -> None:
    from tunefleet.workers.serve.app import LoraServer

    bucket = new_bucket(s3_endpoint)
    trainer = open_store(bucket, endpoint_url=s3_endpoint, cache_dir=tmp_path / "trainer")
    weights = {}
    for i in range(3):
        folder = tmp_path / f"adapter-{i}"
        folder.mkdir()
        (folder / "adapter_config.json").write_text("{}")
        weights[f"ftjob-{i}"] = os.urandom(100_000 + i)
        (folder / "adapter_model.safetensors").write_bytes(weights[f"ftjob-{i}"])
        trainer.put_dir(trainer.adapter_key(f"ftjob-{i}"), folder)
    node = open_store(bucket, endpoint_url=s3_endpoint, cache_dir=tmp_path / "node")
    replica = SimpleNamespace(store=node, _prefetched=set(), _prefetching=None)
    prefetch = LoraServer.func_or_class.prefetch

    # one adapter was deleted meanwhile: the others still come, it is tried again later
    prefetch(replica, ["ftjob-0", "ftjob-1", "ftjob-gone"])
    replica._prefetching.join(60)
    assert replica._prefetched == {"ftjob-0", "ftjob-1"}
    fetched = (node.fetched.bytes, node.fetched.objects)
    assert fetched[0] == sum(len(weights[a]) + 2 for a in ("ftjob-0", "ftjob-1"))
    for adapter_id in ("ftjob-0", "ftjob-1"):
        copy = node.cache.path(node.adapter_key(adapter_id))
        assert (copy / "adapter_model.safetensors").read_bytes() == weights[adapter_id]
        assert node.pinned_copy(node.adapter_key(adapter_id)).path == copy  # a load's path
    # the loads read not a byte from object storage (the store's own counters)
    assert (node.fetched.bytes, node.fetched.objects) == fetched
    assert not node.cache.exists(node.adapter_key("ftjob-2"))

    # the next push brings a new adapter: only it is copied
    first = replica._prefetching
    prefetch(replica, ["ftjob-2", "ftjob-0", "ftjob-1"])
    assert replica._prefetching is not first
    replica._prefetching.join(60)
    assert replica._prefetched == {"ftjob-0", "ftjob-1", "ftjob-2"}
    assert node.cache.exists(node.adapter_key("ftjob-2"))
