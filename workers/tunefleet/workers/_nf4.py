"""Bases quantized to 4 bits by bitsandbytes (QLoRA), shared by training and serving:
keeping their forward in the compute dtype they were loaded with on every CPU, and
de-quantizing them into the plain layers that compute what they compute.

bitsandbytes 0.50 takes a second path on a CPU with AVX512-BF16: the first forward of a
``Linear4bit`` in eval mode without gradients repacks its weight into a blocked layout
(``quant_state.absmax`` cast to bf16, ``quant_state.dtype`` set to bf16), and every forward
after that multiplies in bf16 whatever the compute dtype, also in training mode, through a
kernel registered without a backward. Answers then depend on the CPU kind, an adapter
trained with fp32 compute is served in bf16, and transformers' ``dequantize`` reads the
repacked weight as if it were in the plain layout (scrambled weights, "dequantized in
torch.bfloat16").
"""

from __future__ import annotations

import copy
from typing import Any

from torch import nn


def load_4bit(
    model_path: str, *, quant_type: str, double_quant: bool, compute_dtype: Any, **kwargs: Any
) -> Any:
    """A causal LM from ``model_path`` with its linear layers quantized to 4 bits by
    bitsandbytes, computing in ``compute_dtype`` on every CPU (``keep_compute_dtype``):
    the base QLoRA trains on and the base its adapters are served on."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    model = AutoModelForCausalLM.from_pretrained(
        model_path,
        quantization_config=BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=quant_type,
            bnb_4bit_use_double_quant=double_quant,
            bnb_4bit_compute_dtype=compute_dtype,
        ),
        dtype=compute_dtype,
        **kwargs,
    )
    keep_compute_dtype(model)
    return model


def keep_compute_dtype(model: nn.Module) -> None:
    """Turn off bitsandbytes' AVX512-BF16 CPU path in every ``Linear4bit`` of ``model``:
    their forward then de-quantizes into the compute dtype and multiplies there, as on
    every other CPU and in training."""
    from bitsandbytes.nn.modules import Linear4bit

    for module in model.modules():
        if isinstance(module, Linear4bit):
            module.support_avx512bf16_for_cpu = False


def dequantize_4bit_model(model: Any) -> Any:
    """``model`` with every bitsandbytes ``Linear4bit`` replaced, in place, by an
    ``nn.Linear`` holding the weight that layer's forward multiplies by:
    ``dequantize_4bit`` straight into the layer's compute dtype (transformers'
    ``dequantize`` goes through the quantized weight's dtype first). Its quantization
    attributes are cleared as transformers' ``dequantize`` clears them (and
    ``is_loaded_in_4bit``, which that leaves), so it saves as a plain model."""
    from bitsandbytes.functional import dequantize_4bit
    from bitsandbytes.nn.modules import Linear4bit

    for name, module in list(model.named_modules()):
        if not isinstance(module, Linear4bit):
            continue
        state: Any = getattr(module.weight, "quant_state", None) or module.quant_state
        if getattr(state, "packing_format_for_cpu", False):
            raise ValueError(
                f"layer {name} was repacked by bitsandbytes for its AVX512-BF16 CPU kernel, "
                "which multiplies in bf16: no plain layer computes what it does; load the "
                "base with keep_compute_dtype applied (nf4.load_4bit does) "
                "before running it"
            )
        state = copy.copy(state)  # the compute dtype, not the dtype the weight was saved in
        state.dtype = module.compute_dtype or state.dtype
        linear = nn.Linear(
            module.in_features, module.out_features, bias=module.bias is not None, device="meta"
        )
        linear.weight = nn.Parameter(dequantize_4bit(module.weight.data, state))
        if module.bias is not None:
            linear.bias = nn.Parameter(module.bias.data.to(state.dtype))
        model.set_submodule(name, linear)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    vars(model).pop("is_loaded_in_4bit", None)
    return model
