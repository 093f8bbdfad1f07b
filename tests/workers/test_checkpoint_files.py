"""Checkpoint files (``tunefleet.workers.train._checkpoint``) for optimizers whose states
are not one plain tensor per parameter."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tunefleet.platform.spec import JobSpec
from tunefleet.workers.train import _checkpoint as ckpt_files
from tunefleet.workers.train._methods import BuiltModel


def _spec() -> JobSpec:
    return JobSpec.model_validate(
        {
            "job_id": "ftjob-ckpt",
            "tenant_id": "t",
            "model": "tiny",
            "training_file": "file-1",
            "hyperparameters": {"n_epochs": 1, "batch_size": 1, "learning_rate_multiplier": 1},
            "seed": 0,
            "tunefleet": {"method": "full", "optimizer": "adamw_8bit"},
        }
    )


def test_an_8bit_optimizers_shared_quantization_maps_are_saved_and_restored(
    tmp_path: Path,
) -> None:
    """bitsandbytes' 8-bit AdamW (QLoRA's optimizer on GPUs) shares its ``qmap`` tensors
    across parameters; safetensors refuses shared tensors, so the checkpoint of a QLoRA
    job failed at its first save on a GPU. Saved, then restored into a fresh optimizer:
    every state tensor equal."""
    from bitsandbytes.optim import AdamW8bit

    def model() -> torch.nn.Module:
        torch.manual_seed(0)  # 8-bit states are kept for tensors of 4096+ elements
        return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 64))

    net = model()
    optimizer = AdamW8bit(net.parameters(), lr=1e-3)
    for _ in range(2):
        net(torch.randn(3, 64)).square().mean().backward()
        optimizer.step()
    maps = [
        t.untyped_storage().data_ptr() for t in _leaves(optimizer.state_dict()["state"], "qmap1")
    ]
    assert len(maps) >= 2 and len(set(maps)) == 1  # one map shared by two parameters' states
    scheduler: Any = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    built = BuiltModel(net, "full", 0, 0)
    ckpt_files.save(tmp_path, built, _spec(), optimizer, scheduler, {"step": 2}, [])

    again = model()
    restored = AdamW8bit(again.parameters(), lr=1e-3)
    ckpt_files.load_state(
        tmp_path, restored, torch.optim.lr_scheduler.LambdaLR(restored, lambda _: 1.0)
    )
    saved, got = _flat(optimizer.state_dict()["state"]), _flat(restored.state_dict()["state"])
    assert got.keys() == saved.keys()
    for name, value in saved.items():
        assert torch.equal(torch.as_tensor(got[name]), torch.as_tensor(value)), name


def _flat(state: Any, prefix: str = "") -> dict[str, Any]:
    """A nested optimizer state as {path: leaf}."""
    if not isinstance(state, dict):
        return {prefix: state}
    return {k: v for key, sub in state.items() for k, v in _flat(sub, f"{prefix}/{key}").items()}


def _leaves(state: Any, name: str) -> list[torch.Tensor]:
    return [v for k, v in _flat(state).items() if k.endswith("/" + name)]
