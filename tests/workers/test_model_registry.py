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


# Tiny random configs of each Llama-family architecture the planner knows (transformers
# model types), at the tiny Llama's sizes.
ARCHITECTURES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3"]


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_the_planners_parameter_counts_are_the_real_models(model_type: str) -> None:
    """Total, LoRA (every projection), IA3 and bias parameters as the planner counts them from
    the saved config are what the real model, and peft on it, count. On Phi-3 the Llama
    names target its fused qkv_proj and gate_up_proj: fewer LoRA parameters than on
    separate projections (one A per fused module)."""
    from peft import IA3Config, LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from tunefleet.platform.planner import ModelShape, PlanInput, lora_params, parameter_counts
    from tunefleet.platform.spec import LINEAR_MODULES, model_targets

    config = AutoConfig.for_model(
        model_type, vocab_size=320, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        pad_token_id=0, eos_token_id=1, bos_token_id=None,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    saved = json.loads(model.config.to_json_string())  # what config.json holds
    shape = ModelShape.from_config(saved)
    assert shape.total_params == sum(p.numel() for p in model.parameters())
    biases = sum(p.numel() for n, p in model.named_parameters() if n.endswith(".bias"))
    assert shape.bias_params == biases
    assert (biases > 0) == (model_type == "qwen2")  # Qwen2's q, k and v
    assert set(shape.linear_shapes()) == {
        n.rsplit(".", 1)[-1]
        for n, m in model.model.layers[0].named_modules()
        if hasattr(m, "in_features")
    }
    targets = model_targets(list(LINEAR_MODULES), shape.fused)
    assert shape.fused == (model_type == "phi3") and len(targets) == (4 if shape.fused else 7)
    lora = get_peft_model(model, LoraConfig(r=8, target_modules=targets))
    trainable = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert lora_params(shape, 8, list(LINEAR_MODULES)) == trainable
    ia3 = PlanInput(method="ia3")  # its defaults: k_proj, v_proj, down_proj
    scaled = get_peft_model(
        AutoModelForCausalLM.from_config(config),
        IA3Config(
            target_modules=model_targets(list(ia3.ia3_targets), shape.fused),
            feedforward_modules=model_targets(list(ia3.ia3_feedforward), shape.fused),
        ),
    )
    vectors = sum(p.numel() for p in scaled.parameters() if p.requires_grad)
    assert parameter_counts(shape, ia3)[0] == vectors


def test_bitfit_is_offered_on_qwen2s_biases_and_refused_on_llamas_none() -> None:
    """Qwen2's configs say nothing of biases (its q, k and v always have them): BitFit
    is decided by what the planner counts, not by the config's attention_bias."""
    from transformers import AutoConfig

    from tunefleet.platform.jobs import JobCreateRequest, build_spec

    req = JobCreateRequest.model_validate(
        {"model": "m", "training_file": "file-1", "tunefleet": {"method": "bitfit"}}
    )
    sizes = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4}  # fmt: skip
    for model_type, offered in (("qwen2", True), ("llama", False)):
        config = json.loads(AutoConfig.for_model(model_type, **sizes).to_json_string())
        assert "attention_bias" not in config or not config["attention_bias"]
        if offered:
            spec, _ = build_spec(req, job_id="j", tenant_id="t", config=config, examples=8)
            assert spec.tunefleet.method == "bitfit"
        else:
            with pytest.raises(InvalidRequest, match="BitFit trains only the bias terms"):
                build_spec(req, job_id="j", tenant_id="t", config=config, examples=8)


def test_phi3_targets_map_to_its_fused_modules_and_fused_names_elsewhere_are_refused() -> None:
    """Phi-3 computes q, k, v in one qkv_proj and gate, up in one gate_up_proj: the Llama
    names of a job's targets (and the defaults) name those, once each; a fused name on a
    model without them is a 400 naming the model's own modules."""
    from transformers import AutoConfig

    from tunefleet.platform.jobs import JobCreateRequest, build_spec
    from tunefleet.platform.planner import ModelShape, lora_params, resolve_targets

    sizes = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    phi3 = json.loads(AutoConfig.for_model("phi3", **sizes).to_json_string())
    llama = json.loads(AutoConfig.for_model("llama", **sizes).to_json_string())

    def job(options: dict[str, object], config: dict[str, object]) -> object:
        req = JobCreateRequest.model_validate(
            {"model": "m", "training_file": "file-1", "tunefleet": options}
        )
        return build_spec(req, job_id="j", tenant_id="t", config=config, examples=8)[0]

    shape = ModelShape.from_config(phi3)
    assert resolve_targets(shape, ["q_proj", "v_proj"]) == ["qkv_proj"]
    assert resolve_targets(shape, ["k_proj", "v_proj", "down_proj"]) == ["qkv_proj", "down_proj"]
    assert resolve_targets(shape, ["all-linear"]) == [
        "qkv_proj",
        "o_proj",
        "gate_up_proj",
        "down_proj",
    ]
    assert lora_params(shape, 8, ["q_proj", "v_proj"]) == 2 * 8 * (64 + 64 + 2 * 32)
    job({"method": "lora", "lora": {"target_modules": ["q_proj", "v_proj"]}}, phi3)
    job({"method": "lora", "lora": {"target_modules": ["gate_up_proj"]}}, phi3)
    job({"method": "ia3"}, phi3)  # the defaults: k_proj, v_proj, down_proj
    for options, field in (
        ({"method": "lora", "lora": {"target_modules": ["qkv_proj"]}}, "lora"),
        ({"method": "ia3", "ia3": {"target_modules": ["gate_up_proj"], "feedforward_modules": []}},
         "ia3"),
    ):  # fmt: skip
        with pytest.raises(InvalidRequest) as refused:
            job(options, llama)
        assert refused.value.param == f"tunefleet.{field}.target_modules"
        assert "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj" in str(refused.value)
