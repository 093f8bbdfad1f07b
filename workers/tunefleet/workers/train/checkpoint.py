"""Checkpoint files: the adapter in peft format plus trainer state, safetensors only.

A checkpoint folder holds ``adapter/`` (``adapter_model.safetensors`` and
``adapter_config.json``), ``optimizer.safetensors`` (every optimizer state tensor, keyed
``{param_index}.{name}``, plus the CPU random-number state as ``rng``, so dropout after a
resume draws what it would have drawn) and ``trainer_state.json`` (step, token count,
param groups, scheduler state). No pickle is written or read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from peft import set_peft_model_state_dict
from safetensors.torch import load_file, save_file

ADAPTER_DIR = "adapter"


def save(
    folder: Path,
    peft_model: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    extra: dict[str, Any],
) -> None:
    peft_model.save_pretrained(folder / ADAPTER_DIR, safe_serialization=True)
    opt = optimizer.state_dict()
    tensors = {
        f"{idx}.{name}": value.detach().contiguous()
        for idx, state in opt["state"].items()
        for name, value in state.items()
        if isinstance(value, torch.Tensor)
    }
    tensors["rng"] = torch.get_rng_state()
    save_file(tensors, str(folder / "optimizer.safetensors"))
    state = {"param_groups": opt["param_groups"], "scheduler": scheduler.state_dict(), **extra}
    (folder / "trainer_state.json").write_text(json.dumps(state))


def load(
    folder: Path, peft_model: Any, optimizer: torch.optim.Optimizer, scheduler: Any
) -> dict[str, Any]:
    """Restore adapter weights, optimizer and scheduler; returns the saved extras."""
    weights = load_file(str(folder / ADAPTER_DIR / "adapter_model.safetensors"))
    set_peft_model_state_dict(peft_model, weights)
    state = json.loads((folder / "trainer_state.json").read_text())
    opt_state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in load_file(str(folder / "optimizer.safetensors")).items():
        if key == "rng":
            torch.set_rng_state(value)
            continue
        idx, name = key.split(".", 1)
        opt_state.setdefault(int(idx), {})[name] = value
    optimizer.load_state_dict({"state": opt_state, "param_groups": state.pop("param_groups")})
    scheduler.load_state_dict(state.pop("scheduler"))
    return dict(state)
