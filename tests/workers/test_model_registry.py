"""The base-model registry on real transformers checkpoints: a model saved in shards (as
transformers saves any model past its shard size, a 7B one in four) is listed, loads with
the weights it was saved with, and one missing a shard is refused naming the shard."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tunefleet.platform.errors import InvalidRequest
from tunefleet.platform.models import SHARD_INDEX, ModelRegistry

TINY = "tiny-llama"


def _sharded(registry: Path, source: Path, name: str) -> Path:
    """``source``'s model saved again in shards of at most 100 kB, with its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    folder = registry / name
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="100KB")
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return folder


def test_a_sharded_model_is_listed_and_loads_and_a_missing_shard_is_named(
    tiny_registry: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    registry = tmp_path / "models"
    folder = _sharded(registry, tiny_registry / TINY, "tiny-sharded")
    shards = sorted(p.name for p in folder.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and not (folder / "model.safetensors").exists()
    models = ModelRegistry(registry)
    assert models.names() == ["tiny-sharded"]
    loaded = AutoModelForCausalLM.from_pretrained(models.require("tiny-sharded"))
    original = AutoModelForCausalLM.from_pretrained(tiny_registry / TINY)
    for (name, got), (_, want) in zip(
        loaded.state_dict().items(), original.state_dict().items(), strict=True
    ):
        assert torch.equal(got, want), name

    # one shard gone (a copy cut short): not listed, and naming it is a clear error
    broken = _sharded(registry, tiny_registry / TINY, ".tmp-broken")
    (broken / shards[-1]).unlink()
    broken.rename(registry / "tiny-broken")
    assert models.names() == ["tiny-sharded"]
    with pytest.raises(InvalidRequest) as refused:
        models.require("tiny-broken")
    assert shards[-1] in refused.value.message and "incomplete" in refused.value.message

    # an index that names a path outside the model's folder is not a complete model
    index = json.loads((folder / SHARD_INDEX).read_text())
    index["weight_map"] = {k: f"../{v}" for k, v in index["weight_map"].items()}
    escaping = registry / "tiny-escaping"
    escaping.mkdir()
    (escaping / "config.json").write_text((folder / "config.json").read_text())
    (escaping / SHARD_INDEX).write_text(json.dumps(index))
    with pytest.raises(InvalidRequest, match="names shards that are not there"):
        models.require("tiny-escaping")
    # and a name that is not a folder of the registry is unknown, as before
    with pytest.raises(InvalidRequest, match=r"unknown base model '\.\./tiny-sharded'"):
        models.require("../tiny-sharded")
