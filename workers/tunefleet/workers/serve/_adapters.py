"""What an adapter folder and a base model hold, as batched serving reads them: a peft
LoRA adapter's configuration and factors (refusing what batched serving cannot apply
exactly), and the base model in fp32 or 4-bit NF4."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from tunefleet.platform.artifacts import METHOD_FILE
from tunefleet.workers._nf4 import dequantize_4bit_model, load_4bit
from tunefleet.workers._precision import device_choice

_PEFT_PREFIX = "base_model.model."


class AdapterError(ValueError):
    """An adapter this server cannot serve; the message names it and says why."""

    code = "adapter_unservable"  # the OpenAI-style error code of the 400 it becomes


def read_adapter(folder: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``adapter_config.json`` and ``adapter_model.safetensors`` of a peft LoRA folder,
    refusing what batched serving cannot apply exactly."""
    config_path = folder / "adapter_config.json"
    weights_path = folder / "adapter_model.safetensors"
    method_path = folder / METHOD_FILE
    if method_path.is_file():
        method = json.loads(method_path.read_text()).get("method")
        raise AdapterError(
            f"the model at {folder} was trained with method {method!r}; TuneFleet serves "
            "LoRA and QLoRA fine-tunes (batched) and IA3 (merged)"
        )
    if not config_path.is_file() or not weights_path.is_file():
        raise AdapterError(
            f"{folder} is not a peft adapter folder (needs adapter_config.json and "
            "adapter_model.safetensors; only safetensors are read)"
        )
    config = json.loads(config_path.read_text())
    peft_type = config.get("peft_type", "LORA")
    if peft_type == "IA3":
        raise AdapterError(f"adapter at {folder} is IA3: serve it merged")
    if peft_type != "LORA":
        raise AdapterError(
            f"adapter at {folder} is {peft_type}; TuneFleet serves LoRA and QLoRA "
            "fine-tunes (batched) and IA3 (merged)"
        )
    if config.get("use_dora"):
        raise AdapterError(
            f"adapter at {folder} uses DoRA, whose magnitude vector depends on the merged "
            "weight; serve it merged instead"
        )
    if config.get("modules_to_save"):
        raise AdapterError(
            f"adapter at {folder} also trains whole modules {config['modules_to_save']}; "
            "serve it merged instead"
        )
    if config.get("bias", "none") != "none":
        raise AdapterError(f"adapter at {folder} trains biases; serve it merged instead")
    return config, load_file(str(weights_path))


def _scale(config: dict[str, Any], module: str, rank: int) -> float:
    alpha = float(config.get("lora_alpha", rank))
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if module == pattern or module.endswith(f".{pattern}"):
            alpha = float(value)
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def factors(
    config: dict[str, Any], weights: dict[str, torch.Tensor]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Module name -> (A, scale * B) from a peft state dict."""
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for key, a in weights.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key.removeprefix(_PEFT_PREFIX).removesuffix(".lora_A.weight")
        b = weights.get(key.replace(".lora_A.", ".lora_B."))
        if b is None:
            raise AdapterError(f"adapter has lora_A for {module} but no lora_B")
        rank = a.shape[0]
        out[module] = (a.float(), b.float() * _scale(config, module, rank))
    if not out:
        raise AdapterError("adapter holds no LoRA weights")
    return out


def serving_precision(asked: str) -> tuple[str, str]:
    """What a replica serves its base in: ``asked``, or for ``auto`` what precision
    ``auto`` trains in on this machine's CPU (``_precision.device_choice``): bf16 where it
    computes bf16 natively, else fp32; and why."""
    if asked != "auto":
        return asked, f"{asked}, as the operator set it (TUNEFLEET_SERVE_PRECISION)"
    chosen, why = device_choice(torch.device("cpu"))
    return chosen, f"auto: {why}"


def load_serving_base(
    model_path: str | Path, quantization: str = "none", dtype: torch.dtype = torch.float32
) -> nn.Module:
    """The base model for serving, in ``dtype`` (fp32 or bf16), or quantized to 4-bit NF4
    (double quantization, computing in ``dtype``: ``nf4.load_4bit``) to serve QLoRA
    adapters on the base they were trained on."""
    from transformers import AutoModelForCausalLM

    model: nn.Module
    if quantization == "nf4":
        model = load_4bit(str(model_path), quant_type="nf4", double_quant=True, compute_dtype=dtype)
    elif quantization == "none":
        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype)
    else:
        raise ValueError(f"base_quantization {quantization!r}: use 'none' or 'nf4'")
    return model.eval()


def merge_into_copy(base: Any, folder: Path) -> Any:
    """The adapter merged (``merge_and_unload``) into ``base``, a copy of the served base;
    a 4-bit base is first de-quantized into the weights its forward multiplies by."""
    from peft import PeftModel

    if getattr(base, "is_loaded_in_4bit", False):
        base = dequantize_4bit_model(base)
    return PeftModel.from_pretrained(base, str(folder)).merge_and_unload().eval()
