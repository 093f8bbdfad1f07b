"""The node's artifact cache (``platform/node_cache.py``) on a real S3 server (moto's):
within its byte budget by least-recently-used eviction, a copy in use never evicted,
concurrent fills of one artifact one download, a partial download never visible."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from s3 import new_bucket
from tunefleet.platform.artifacts import S3Store, open_store
from tunefleet.platform.node_cache import CacheTooSmall, NodeCache
from tunefleet.platform.settings import Settings, parse_quantity

ADAPTER_BYTES = 100_000


def _adapters(store: S3Store, tmp_path: Path, n: int) -> list[str]:
    """``n`` adapters' folders in the bucket (a config and 100 kB of weights each)."""
    keys = []
    for i in range(n):
        folder = tmp_path / f"adapter-{i}"
        folder.mkdir()
        (folder / "adapter_config.json").write_text("{}")
        (folder / "adapter_model.safetensors").write_bytes(os.urandom(ADAPTER_BYTES))
        keys.append(store.adapter_key(f"ftjob-{i}"))
        store.put_dir(keys[-1], folder)
    return keys


def _node(bucket: str, endpoint: str, cache: Path, budget: int) -> S3Store:
    store = open_store(bucket, endpoint_url=endpoint, cache_dir=cache, cache_size=budget * 10 // 9)
    assert isinstance(store, S3Store)
    assert store.node_cache.budget_bytes in (budget, budget - 1)  # 90% of the size given
    return store


def test_eviction_keeps_the_cache_within_its_budget_and_spares_a_copy_in_use(
    s3_endpoint: str, tmp_path: Path
) -> None:
    """Six 100 kB adapters through a cache of 350 kB, the first pinned (a replica has it
    loaded): after every fill the cache is within budget; the least recently used unpinned
    copies went, the pinned one stayed though it is the oldest; a copy used again is kept
    over older ones. Released, the pinned copy is evicted like any other."""
    bucket = new_bucket(s3_endpoint)
    trainer = open_store(bucket, endpoint_url=s3_endpoint, cache_dir=tmp_path / "trainer")
    assert isinstance(trainer, S3Store)
    keys = _adapters(trainer, tmp_path, 6)
    node = _node(bucket, s3_endpoint, tmp_path / "node", budget=350_000)
    cache = node.node_cache

    pin = node.pinned_copy(keys[0])
    assert (pin.path / "adapter_model.safetensors").stat().st_size == ADAPTER_BYTES
    node.local_copy(keys[1])
    node.local_copy(keys[2])
    node.local_copy(keys[1])  # used again: now more recent than 2
    for key in keys[3:]:
        node.local_copy(key)
        assert cache.usage().bytes <= cache.budget_bytes
    held = {k for k in keys if cache.path(k).exists()}
    assert held == {keys[0], keys[4], keys[5]}, held  # 2 went before 1, both before 3
    usage = cache.usage()
    assert usage.copies == 3 and usage.pinned_bytes > ADAPTER_BYTES
    assert (pin.path / "adapter_model.safetensors").stat().st_size == ADAPTER_BYTES

    pin.release()
    fetched = node.fetched.bytes
    node.local_copy(keys[1])  # evicts keys[0], the least recently used, now unpinned
    assert node.fetched.bytes == fetched + ADAPTER_BYTES + 2  # downloaded again
    assert not cache.path(keys[0]).exists() and cache.usage().bytes <= cache.budget_bytes
    assert not list((cache.root / ".tmp").iterdir())  # nothing left half-deleted


def test_concurrent_fills_of_one_artifact_are_one_download(
    s3_endpoint: str, tmp_path: Path
) -> None:
    """Eight threads across two stores on one cache folder (two processes of a node:
    separate lock files' descriptions, as separate processes have) ask for one adapter at
    once: one of them downloads it, the others wait and get the same whole copy."""
    bucket = new_bucket(s3_endpoint)
    trainer = open_store(bucket, endpoint_url=s3_endpoint, cache_dir=tmp_path / "trainer")
    assert isinstance(trainer, S3Store)
    (key,) = _adapters(trainer, tmp_path, 1)
    processes = [_node(bucket, s3_endpoint, tmp_path / "node", 1 << 20) for _ in range(2)]
    start = threading.Barrier(8)

    def fill(i: int) -> Path:
        start.wait()
        return processes[i % 2].local_copy(key)

    with ThreadPoolExecutor(8) as pool:
        copies = set(pool.map(fill, range(8)))
    assert len(copies) == 1
    (copy,) = copies
    assert (copy / "adapter_model.safetensors").stat().st_size == ADAPTER_BYTES
    assert sum(p.fetched.objects for p in processes) == 2  # its two files, once
    assert sum(p.fetched.bytes for p in processes) == ADAPTER_BYTES + 2


def test_a_download_cut_short_leaves_nothing_and_an_oversize_artifact_is_refused(
    tmp_path: Path,
) -> None:
    cache = NodeCache(tmp_path / "cache", budget_bytes=1000)

    def broken(tmp: Path) -> None:
        tmp.mkdir()
        (tmp / "half").write_bytes(b"x" * 300)
        raise ConnectionError("storage went away")

    with pytest.raises(ConnectionError):
        cache.fill("adapters/a", broken, lambda: 600)
    assert not cache.path("adapters/a").exists()
    assert cache.usage().copies == 0 and not list((cache.root / ".tmp").iterdir())

    def whole(tmp: Path) -> None:
        tmp.write_bytes(b"y" * 600)

    path, _ = cache.fill("adapters/a", whole, lambda: 600)
    assert path.read_bytes() == b"y" * 600
    with pytest.raises(CacheTooSmall, match=r"adapters/b is 5000 bytes.*ARTIFACT_CACHE"):
        cache.fill("adapters/b", whole, lambda: 5000)
    with pytest.raises(ValueError, match="escapes"):
        cache.fill("../elsewhere", whole, lambda: 1)


def test_the_cache_size_is_a_kubernetes_quantity_or_bytes() -> None:
    assert parse_quantity("20Gi") == 20 << 30
    assert parse_quantity("500M") == 500_000_000
    assert Settings(artifact_cache_size="1Gi").artifact_cache_size == 1 << 30  # type: ignore[arg-type]
    assert Settings(artifact_cache_size=4096).artifact_cache_size == 4096
    with pytest.raises(ValueError, match=r"'20 gigs' is not a size.*20Gi"):
        Settings(artifact_cache_size="20 gigs")  # type: ignore[arg-type]
