"""FSDP2 for the training loop: ``fully_shard`` on every decoder layer, then on the whole
model, in a ZeRO-3 mode (a layer's gathered parameters are freed after its forward and
gathered again for its backward) or a ZeRO-2 mode (kept from forward to backward: less
communication, more memory); parameters, gradients and optimizer states stay sharded
across the workers either way. With bf16/fp16 a ``MixedPrecisionPolicy`` gathers the
parameters in that dtype and reduces gradients in fp32 (the shards, i.e. the master
weights, and the optimizer states stay fp32). ``zero3_offload`` keeps the shards in host
memory (GPU workers).

LoRA and the other few-parameter methods shard the frozen base as well as the trained
tensors. QLoRA's 4-bit base weights (bitsandbytes ``Params4bit``) cannot be split as
DTensors and stay whole on every worker (they are a quarter of bf16's size); its LoRA
tensors and their optimizer states are sharded.

Checkpoints hold full tensors: ``gather_state`` collects the trained tensors and the
optimizer state on rank 0 (a collective: every rank calls it), keyed by parameter name.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tunefleet.workers.train._methods import DTYPES, decoder_layers

RESHARD_AFTER_FORWARD = {"zero2": False, "zero3": True, "zero3_offload": True}


def shard_model(model: nn.Module, strategy: str, precision: str) -> nn.Module:
    """Shard ``model`` in place across the default process group (every rank calls this)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, Any] = {"reshard_after_forward": RESHARD_AFTER_FORWARD[strategy]}
    if precision in ("bf16", "fp16"):
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=DTYPES[precision], reduce_dtype=torch.float32
        )
    if strategy == "zero3_offload":
        kwargs["offload_policy"] = CPUOffloadPolicy()
    whole = {p for p in model.parameters() if type(p).__name__ == "Params4bit"}
    for layer in decoder_layers(model, "FSDP (strategy zero2/zero3)"):
        fully_shard(layer, ignored_params=whole or None, **kwargs)
    fully_shard(model, ignored_params=whole or None, **kwargs)
    return model


def gather_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Full trained tensors (``model``: name -> tensor) and optimizer state (``optimizer``,
    keyed by parameter name) on rank 0, in host memory; empty dicts on the other ranks."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    return {
        "model": get_model_state_dict(model, options=options),
        "optimizer": get_optimizer_state_dict(model, optimizer, options=options),
    }


def load_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Restore a gathered optimizer state (keyed by parameter name) into the shards; every
    rank calls this with the same full state."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(
        model, optimizer, state, options=StateDictOptions(full_state_dict=True)
    )


def local_value(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (e.g. the global gradient norm), a tensor as it is."""
    full = getattr(t, "full_tensor", None)
    return full() if full is not None else t
