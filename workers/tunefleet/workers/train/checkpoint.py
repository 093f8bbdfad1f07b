"""Checkpoint files: the method's weights plus trainer state, safetensors only.

A checkpoint folder holds ``adapter/`` (the method's weights: peft format for the peft
methods, ``trainable.safetensors`` otherwise; see ``methods.py``), ``optimizer.safetensors``
(every optimizer state tensor, keyed by its path ``{param_index}/{name}[/{name}...]`` —
bitsandbytes nests its 8-bit states in a dict —, plus the CPU random-number state as
``rng``, so dropout after a resume draws what it would have drawn) and
``trainer_state.json`` (step, token count, param groups, the optimizer's other state,
scheduler and loss-scaler state). No pickle is written or read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tunefleet.platform.spec import JobSpec
from tunefleet.workers.train.methods import BuiltModel, load_weights, save_weights

ADAPTER_DIR = "adapter"


def save(
    folder: Path,
    built: BuiltModel,
    spec: JobSpec,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    extra: dict[str, Any],
    scaler: Any = None,
) -> None:
    save_weights(folder / ADAPTER_DIR, built, spec)
    opt = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    _flatten(opt["state"], "", tensors, scalars)
    tensors["rng"] = torch.get_rng_state()
    save_file(tensors, str(folder / "optimizer.safetensors"))
    state = {
        "param_groups": opt["param_groups"],
        "optimizer_scalars": scalars,
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None and scaler.is_enabled() else None,
        **extra,
    }
    (folder / "trainer_state.json").write_text(json.dumps(state))


def load(
    folder: Path,
    built: BuiltModel,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    scaler: Any = None,
) -> dict[str, Any]:
    """Restore the method's weights, optimizer, scheduler and loss scaler; returns the
    saved extras."""
    load_weights(folder / ADAPTER_DIR, built)
    state = json.loads((folder / "trainer_state.json").read_text())
    tensors = load_file(str(folder / "optimizer.safetensors"))
    torch.set_rng_state(tensors.pop("rng"))
    nested: dict[str, Any] = {}
    for path, value in [*tensors.items(), *state.pop("optimizer_scalars", {}).items()]:
        # checkpoints written before nested states were kept used "{idx}.{name}"
        *parents, leaf = path.split("/") if "/" in path else path.split(".", 1)
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    opt_state = {int(idx): values for idx, values in nested.items()}
    optimizer.load_state_dict({"state": opt_state, "param_groups": state.pop("param_groups")})
    scheduler.load_state_dict(state.pop("scheduler"))
    scaler_state = state.pop("scaler", None)
    if scaler is not None and scaler_state:
        scaler.load_state_dict(scaler_state)
    return dict(state)


def _flatten(
    node: dict[Any, Any], prefix: str, tensors: dict[str, torch.Tensor], other: dict[str, Any]
) -> None:
    """Tensors and other values of a nested state dict, keyed by ``a/b/c`` paths."""
    for key, value in node.items():
        path = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            tensors[path] = value.detach().contiguous()
        elif isinstance(value, dict):
            _flatten(value, path + "/", tensors, other)
        else:
            other[path] = value
