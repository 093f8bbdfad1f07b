"""The fine-tuning methods: what each one makes trainable, and how its weights are saved.

- ``lora``, ``qlora`` (LoRA on a base quantized to 4 bits by bitsandbytes), ``ia3``,
  ``prefix_tuning``, ``prompt_tuning``: peft models; their weights are saved in peft's
  format (``adapter_config.json`` + ``adapter_model.safetensors``).
- ``full``: every parameter; ``bitfit``: only the bias terms; ``adapter``: a bottleneck MLP
  after every decoder block (Houlsby et al.), ``h + up(gelu(down(h)))`` with ``up``
  starting at zero so training starts from the base model. Their trainable parameters are
  saved by name in ``trainable.safetensors`` beside ``tunefleet_method.json``.

With bf16 or fp16 precision the frozen base is stored in that dtype and every trainable
parameter in fp32 (master weights; the optimizer's states follow them); full fine-tuning
keeps all weights in fp32 and autocasts the compute.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tunefleet.platform.artifacts import METHOD_FILE
from tunefleet.platform.planner import FUSED_TYPES
from tunefleet.platform.spec import PEFT_METHODS, JobSpec, model_targets
from tunefleet.workers._nf4 import dequantize_4bit_model, load_4bit

TRAINABLE_FILE = "trainable.safetensors"

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Bottleneck(nn.Module):
    """``h + up(gelu(down(h)))``; ``up`` starts at zero (the block starts as identity)."""

    def __init__(self, hidden: int, size: int):
        super().__init__()
        self.down = nn.Linear(hidden, size)
        self.up = nn.Linear(size, hidden)
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        delta: torch.Tensor = self.up(nn.functional.gelu(self.down(h.to(self.down.weight.dtype))))
        return h + delta.to(h.dtype)


def _after_block(module: nn.Module, _inputs: Any, output: Any) -> Any:
    adapter: Any = module.tunefleet_adapter
    if isinstance(output, tuple):
        return (adapter(output[0]), *output[1:])
    return adapter(output)


@dataclass
class BuiltModel:
    """The model the loop trains and what it counts."""

    model: Any  # a peft model for the peft methods, the transformers model otherwise
    method: str
    trainable: int
    total: int

    @property
    def is_peft(self) -> bool:
        return self.method in PEFT_METHODS


def decoder_layers(model: Any, purpose: str) -> list[nn.Module]:
    """The transformer blocks of a transformers model, or of the one a peft model wraps;
    ``purpose`` names what needs them in the error for other architectures."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = getattr(getattr(inner, "model", None), "layers", None)
    if layers is None:
        raise ValueError(
            f"{type(inner).__name__} has no model.layers: {purpose} needs a decoder-only "
            "transformer (Llama-like)"
        )
    return list(layers)


def load_base(spec: JobSpec, model_path: str) -> Any:
    """The base model a job trains on: 4-bit for QLoRA (``nf4.load_4bit``), fp32 for full
    fine-tuning (its master weights) and fp32/fp8 runs, else frozen in 16 bits."""
    from transformers import AutoModelForCausalLM

    opts = spec.tunefleet
    kwargs: dict[str, Any] = {"attn_implementation": attention_for(model_path)}
    if opts.rope_scaling is not None:
        kwargs["config"] = rope_scaled_config(model_path, opts.rope_scaling)
    if opts.method == "qlora":
        q = opts.qlora
        return load_4bit(
            model_path,
            quant_type=q.quant_type,
            double_quant=q.double_quant,
            compute_dtype=COMPUTE_DTYPES[q.compute_dtype],
            **kwargs,
        )
    # full fine-tuning keeps fp32 master weights; "auto" is settled by a run's workers
    # before they build (_precision.settle): one built outside a run is fp32
    if opts.method == "full" or opts.precision in ("auto", "fp32", "fp8"):
        kwargs["dtype"] = torch.float32
    else:
        kwargs["dtype"] = DTYPES[opts.precision]  # a frozen base in 16 bits
    return AutoModelForCausalLM.from_pretrained(model_path, **kwargs)


def attention_for(model_path: str) -> str:
    """PyTorch's fused attention (``sdpa``) where the architecture supports it; else
    transformers' own (``eager``): Gemma 2, whose soft-capped attention scores sdpa cannot
    compute."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(model_path))]
    return "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"


def rope_scaled_config(model_path: str, scaling: Any) -> Any:
    """The base's config with ``scaling`` (a ``RopeScaling``) in its RoPE parameters
    (transformers 5's ``rope_parameters``) and a context of factor x the original, except
    for dynamic NTK, which rescales past ``max_position_embeddings`` and so keeps the
    original there."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    original = scaling.original_max_position_embeddings or config.max_position_embeddings
    params = dict(getattr(config, "rope_parameters", None) or {})
    params.update(rope_type=scaling.type, factor=scaling.factor)
    if scaling.type in ("yarn", "dynamic"):
        params["original_max_position_embeddings"] = original
    config.rope_parameters = params
    dynamic = scaling.type == "dynamic"
    config.max_position_embeddings = original if dynamic else int(original * scaling.factor)
    return config


def build_model(spec: JobSpec, model_path: str) -> BuiltModel:
    """The base with the spec's method applied, seeded by the spec."""
    from peft import (
        IA3Config,
        LoraConfig,
        PrefixTuningConfig,
        PromptTuningConfig,
        get_peft_model,
        prepare_model_for_kbit_training,
    )

    torch.manual_seed(spec.seed)
    opts = spec.tunefleet
    method = opts.method
    model = load_base(spec, model_path)
    checkpointing = opts.run_checkpointing
    if checkpointing:
        # Non-reentrant checkpointing needs no input that requires grad, so it works with
        # frozen embeddings under LoRA.
        model.activation_checkpointing_enable({"use_reentrant": False})
    if method == "qlora":
        model = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )
    fused = model.config.model_type in FUSED_TYPES  # Phi-3: q_proj names its qkv_proj
    if method in ("lora", "qlora"):
        lora = opts.lora
        config: Any = LoraConfig(
            r=lora.r,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules="all-linear"
            if lora.target_modules == ["all-linear"]
            else model_targets(lora.target_modules, fused),
            use_rslora=lora.use_rslora,
            use_dora=lora.use_dora,
            task_type="CAUSAL_LM",
        )
    elif method == "ia3":
        config = IA3Config(
            target_modules=model_targets(opts.ia3.target_modules, fused),
            feedforward_modules=model_targets(opts.ia3.feedforward_modules, fused),
            task_type="CAUSAL_LM",
        )
    elif method == "prefix_tuning":
        config = PrefixTuningConfig(
            num_virtual_tokens=opts.virtual_tokens.num_virtual_tokens, task_type="CAUSAL_LM"
        )
    elif method == "prompt_tuning":
        config = PromptTuningConfig(
            num_virtual_tokens=opts.virtual_tokens.num_virtual_tokens,
            prompt_tuning_init="RANDOM",
            task_type="CAUSAL_LM",
        )
    else:
        config = None
    if config is not None:
        model = get_peft_model(model, config)
        trainable, total = model.get_nb_trainable_parameters()
    else:
        _apply_own_method(model, spec)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
    for p in model.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()  # fp32 master weights for whatever is trained
    return BuiltModel(model, method, int(trainable), int(total))


def _apply_own_method(model: Any, spec: JobSpec) -> None:
    method = spec.tunefleet.method
    if method == "full":
        for p in model.parameters():
            p.requires_grad_(True)
        return
    for p in model.parameters():
        p.requires_grad_(False)
    if method == "bitfit":
        biases = [p for name, p in model.named_parameters() if name.endswith(".bias")]
        if not biases:
            raise ValueError(
                f"BitFit trains only bias terms and {spec.model!r} has none; choose another "
                "tunefleet.method, e.g. 'lora' or 'ia3'"
            )
        for p in biases:
            p.requires_grad_(True)
        return
    if method == "adapter":
        hidden = int(model.config.hidden_size)
        for layer in decoder_layers(model, "the bottleneck adapter"):
            layer.tunefleet_adapter = Bottleneck(hidden, spec.tunefleet.adapter.bottleneck)
            layer.register_forward_hook(_after_block)
        return
    raise ValueError(f"unknown method {method!r}")


def trainable_state(built: BuiltModel) -> dict[str, torch.Tensor]:
    return {
        name: p.detach().contiguous()
        for name, p in built.model.named_parameters()
        if p.requires_grad
    }


def save_weights(
    folder: Path, built: BuiltModel, spec: JobSpec, state: dict[str, torch.Tensor] | None = None
) -> None:
    """The method's weights into ``folder`` (peft format, or trainable tensors by name):
    the model's own, or ``state`` (trained tensors by parameter name, gathered from FSDP
    shards)."""
    folder.mkdir(parents=True, exist_ok=True)
    if built.is_peft:
        given = {} if state is None else {"state_dict": state}
        built.model.save_pretrained(folder, safe_serialization=True, **given)
        return
    save_file(trainable_state(built) if state is None else state, str(folder / TRAINABLE_FILE))
    meta = {
        "method": built.method,
        "base_model": spec.model,
        "options": spec.tunefleet.model_dump(mode="json"),
        "trainable": built.trainable,
        "total": built.total,
    }
    (folder / METHOD_FILE).write_text(json.dumps(meta, indent=2))


def load_weights(folder: Path, built: BuiltModel) -> None:
    if built.is_peft:
        from peft import set_peft_model_state_dict

        weights = load_file(str(folder / "adapter_model.safetensors"))
        set_peft_model_state_dict(built.model, weights)
        return
    weights = load_file(str(folder / TRAINABLE_FILE))
    missing = set(trainable_state(built)) - set(weights)
    if missing:
        raise ValueError(f"checkpoint at {folder} lacks {len(missing)} trained tensors")
    with torch.no_grad():
        params = dict(built.model.named_parameters())
        for name, value in weights.items():
            params[name].copy_(value)


def merged_model(spec: JobSpec, model_path: str, folder: Path) -> Any:
    """The base with the weights saved in ``folder`` merged in (see
    ``TuneFleetOptions.merged_model``)."""
    if spec.tunefleet.method in PEFT_METHODS:
        from peft import PeftModel

        base = load_base(spec, model_path)  # QLoRA: the 4-bit base the adapter trained on
        if getattr(base, "is_loaded_in_4bit", False):
            base = dequantize_4bit_model(base)
        return PeftModel.from_pretrained(base, str(folder)).merge_and_unload()
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    result = base.load_state_dict(load_file(str(folder / TRAINABLE_FILE)), strict=False)
    if result.unexpected_keys:
        raise ValueError(f"trained tensors the base lacks: {result.unexpected_keys[:5]}")
    return base
