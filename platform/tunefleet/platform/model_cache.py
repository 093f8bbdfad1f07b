"""A node's copies of base models from the registry, so that replicas and training
workers load from local disk.

The registry is a folder every node mounts (a ReadWriteMany volume: NFS, EFS, Filestore),
read over the network. With ``TUNEFLEET_MODEL_CACHE_SIZE`` set, the processes of a node
that load a base model copy its folder into the node's model cache first, through the
same ``NodeCache`` the artifacts use: one copy per node, made under a temporary name and
renamed into place, waited for by the node's other processes, evicted least recently used
first and never while pinned. A serving replica keeps its model's copy pinned while it
lives; a training worker while it loads.

A copy is keyed by the model's name and a fingerprint of its files (names, sizes and
modification times), so a model removed and added again under its name is copied anew,
and the old copy ages out. Only the folder's own files are copied (what transformers
loads; not sub-folders). A model larger than the cache's budget (90% of it, the rest for
copies in flight) is read in place, and the log says so.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

from tunefleet.platform.artifacts import private_dir
from tunefleet.platform.node_cache import NodeCache, Pin
from tunefleet.platform.settings import Settings

log = logging.getLogger(__name__)


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))


def cache_key(folder: Path) -> str:
    """The cache key of the registry model in ``folder``: its name and its files'
    fingerprint."""
    stats = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in _files(folder)]
    digest = hashlib.sha256(json.dumps(stats).encode()).hexdigest()[:16]
    return f"{folder.name}@{digest}"


def local_model(model_path: str | Path, settings: Settings) -> Pin:
    """The folder to load the registry model at ``model_path`` from, pinned until the pin
    is released: the node's copy with the model cache on, else the folder itself."""
    folder = Path(model_path)
    if not settings.model_cache_size:
        return Pin(folder, -1)
    private_dir(settings.resolved_model_cache, setting="TUNEFLEET_MODEL_CACHE")
    # 10% of the volume kept for copies in flight, as for artifacts
    cache = NodeCache(settings.resolved_model_cache, int(0.9 * settings.model_cache_size))
    files = _files(folder)
    size = sum(f.stat().st_size for f in files)
    if size > cache.budget_bytes:
        log.warning(
            "base model %s (%d bytes) is read from the registry in place: it is larger than "
            "90%% of the node's model cache (TUNEFLEET_MODEL_CACHE_SIZE, the chart's "
            "models.nodeCacheSize, %d bytes); raise it to copy the model to the node",
            folder.name, size, settings.model_cache_size,
        )  # fmt: skip
        return Pin(folder, -1)

    def copy(tmp: Path) -> None:
        tmp.mkdir()
        for f in files:
            shutil.copyfile(f, tmp / f.name)

    _, pin = cache.fill(cache_key(folder), copy, lambda: size, pin=True)
    assert pin is not None
    return pin
