"""The base-model registry: a folder with one safetensors model per sub-folder, its
weights in one ``model.safetensors`` or sharded as transformers saves models past its
shard size (``model-00001-of-00004.safetensors``... listed by
``model.safetensors.index.json``).

This module only reads the registry (no torch). The workers fill it, e.g. by converting
the built-in SmolLM2 GGUF once (``tunefleet models prepare``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tunefleet.platform.errors import InvalidRequest

BUILTIN_MODEL = "SmolLM2-135M-Instruct"
_NAMES_CACHE: dict[Path, tuple[int, list[str]]] = {}
_CONFIG_CACHE: dict[Path, tuple[int, dict[str, Any]]] = {}
SINGLE_WEIGHTS = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"


def missing_weights(folder: Path) -> str | None:
    """Why ``folder`` holds no complete safetensors model (None: it does): no config, no
    weights, an unreadable shard index, or a shard the index names that is not there."""
    if not (folder / "config.json").is_file():
        return f"{folder.name}/config.json is missing"
    if (folder / SINGLE_WEIGHTS).is_file():
        return None
    index = folder / SHARD_INDEX
    if not index.is_file():
        return f"{folder.name} has neither {SINGLE_WEIGHTS} nor {SHARD_INDEX}"
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, AttributeError, TypeError) as exc:
        return f"{folder.name}/{SHARD_INDEX} has no readable weight_map ({exc})"
    absent = [s for s in shards if not (folder / Path(s).name).is_file() or Path(s).name != s]
    if not shards or absent:
        return f"{folder.name}/{SHARD_INDEX} names shards that are not there: {absent or shards}"
    return None


class ModelRegistry:
    def __init__(self, root: Path):
        self.root = root

    def names(self) -> list[str]:
        """Model folders with a config and complete safetensors weights (single or
        sharded: ``missing_weights``), cached per process until
        the registry folder changes (a model is added or removed by renaming into it)."""
        try:
            stamp = self.root.stat().st_mtime_ns
        except FileNotFoundError:
            return []
        cached = _NAMES_CACHE.get(self.root)
        if cached is not None and cached[0] == stamp:
            return list(cached[1])
        names = self._scan()
        _NAMES_CACHE[self.root] = (stamp, names)
        return list(names)

    def _scan(self) -> list[str]:
        return sorted(
            p.name
            for p in self.root.iterdir()
            if not p.name.startswith(".") and p.is_dir() and missing_weights(p) is None
        )

    def path(self, name: str) -> Path:
        return self.root / name

    def created(self, name: str) -> int:
        """When ``name`` was added to the registry, in Unix seconds: its config.json's
        modification time (written once, as the model is prepared; 0 if it is gone)."""
        try:
            return int((self.path(name) / "config.json").stat().st_mtime)
        except FileNotFoundError:
            return 0

    def config(self, name: str) -> dict[str, Any]:
        """The model's config.json, parsed once per process per file version."""
        path = self.path(name) / "config.json"
        stamp = path.stat().st_mtime_ns
        cached = _CONFIG_CACHE.get(path)
        if cached is None or cached[0] != stamp:
            cached = (stamp, json.loads(path.read_text()))
            _CONFIG_CACHE[path] = cached
        return dict(cached[1])

    def require(self, name: str, *, param: str = "model") -> Path:
        """The folder of ``name``, or a 400 that lists what is available."""
        available = self.names()
        folder = self.path(name)
        if name not in available and "/" not in name and not name.startswith("."):
            why = missing_weights(folder) if folder.is_dir() else None
            if folder.is_dir() and why is None:
                return folder  # completed since the listing was cached
            if why is not None:
                raise InvalidRequest(
                    f"base model {name!r} is in the registry but incomplete: {why}; "
                    "copy the model's whole folder again (into a temporary name, then "
                    "rename it into the registry)",
                    param=param,
                    code="model_not_found",
                )
        if name not in available:
            listing = ", ".join(available) if available else "none yet"
            hint = (
                ""
                if available
                else f"; run `tunefleet models prepare` to add the built-in {BUILTIN_MODEL}"
            )
            raise InvalidRequest(
                f"unknown base model {name!r}; available models: {listing}{hint}",
                param=param,
                code="model_not_found",
            )
        return self.path(name)
