"""Checkpoint files: the method's weights plus trainer state, safetensors only.

A checkpoint folder holds ``adapter/`` (the method's weights: peft format for the peft
methods, ``trainable.safetensors`` otherwise; see ``methods.py``), ``optimizer.safetensors``
(every optimizer state tensor, keyed by its path ``{param_index}/{name}[/{name}...]`` —
bitsandbytes nests its 8-bit states in a dict —, plus every rank's random-number states
as ``rng/{rank}`` and, on GPUs, ``cuda_rng/{rank}``, so dropout after a resume draws what
it would have drawn on every worker) and
``trainer_state.json`` (step, token count, param groups, the optimizer's other state,
scheduler and loss-scaler state). No pickle is written or read.

A sharded (FSDP) run saves the full tensors gathered on rank 0 (``sharding.gather_state``):
its optimizer state is keyed by parameter name instead of index (``optimizer_keys``), and
is put back into the shards by ``sharding.load_optimizer_state``. Model weights are loaded
before the model is wrapped or sharded (``load_model``), the rest after the optimizer is
made (``load_state``).
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from tunefleet.platform.artifacts import Keys
from tunefleet.platform.spec import JobSpec
from tunefleet.workers.train._methods import BuiltModel, load_weights, save_weights

ADAPTER_DIR = Keys.CHECKPOINT_WEIGHTS  # serving reads a checkpoint's weights there too


def save(
    folder: Path,
    built: BuiltModel,
    spec: JobSpec,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    extra: dict[str, Any],
    rng: list[dict[str, torch.Tensor]],
    scaler: Any = None,
    gathered: dict[str, Any] | None = None,
) -> None:
    """Write a checkpoint; ``rng`` holds every rank's ``rng_states()``."""
    save_weights(folder / ADAPTER_DIR, built, spec, gathered["model"] if gathered else None)
    if os.environ.get("TUNEFLEET_FAILPOINT") == f"checkpoint.disk_full@{extra['step']}":
        # the fault tests' full disk, half-way through a checkpoint's files
        raise OSError(errno.ENOSPC, "No space left on device", str(folder / "optimizer"))
    opt = gathered["optimizer"] if gathered else optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    _flatten(opt["state"], "", tensors, scalars)
    for rank, states in enumerate(rng):
        tensors.update({f"{name}/{rank}": value for name, value in states.items()})
    save_file(_unshared(tensors), str(folder / "optimizer.safetensors"))
    state = {
        "param_groups": opt["param_groups"],
        "optimizer_scalars": scalars,
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None and scaler.is_enabled() else None,
        "optimizer_keys": "names" if gathered else "indices",
        **extra,
    }
    (folder / "trainer_state.json").write_text(json.dumps(state))


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with a copy of each that shares memory with one before it: safetensors
    refuses shared tensors, and bitsandbytes' 8-bit optimizers share their quantization
    maps (``qmap1``, ``qmap2``) across every parameter's state."""
    seen: set[int] = set()
    out = {}
    for name, tensor in tensors.items():
        ptr = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if ptr and ptr in seen else tensor
        seen.add(ptr)
    return out


def rng_states(device: torch.device, world: int) -> list[dict[str, torch.Tensor]]:
    """Every rank's random-number states (the CPU's, and the GPU's dropout draws from),
    in rank order; all ranks must call it."""
    mine = {"rng": torch.get_rng_state()}
    if device.type == "cuda":
        mine["cuda_rng"] = torch.cuda.get_rng_state(device)
    if world == 1 or not (dist.is_available() and dist.is_initialized()):
        return [mine]
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, {k: v.cpu() for k, v in mine.items()})
    return everyone


def _restore_rng(tensors: dict[str, torch.Tensor], rank: int, device: torch.device) -> None:
    """This rank's states. Checkpoints of older versions kept one CPU state, ``rng``; a rank
    the checkpoint has no state for (the run grew) keeps its seeded one."""
    for name in [k for k in tensors if k == "rng" or k.startswith(("rng/", "cuda_rng/"))]:
        value = tensors.pop(name)
        kind, _, of = name.partition("/")
        if of and int(of) != rank:
            continue
        if kind == "rng":
            torch.set_rng_state(value)
        elif device.type == "cuda":
            torch.cuda.set_rng_state(value, device)


def saved_extras(folder: Path) -> dict[str, Any]:
    """The trainer state a checkpoint was saved with (step, token count, micro-batch...)."""
    state: dict[str, Any] = json.loads((folder / "trainer_state.json").read_text())
    return state


def load_model(folder: Path, built: BuiltModel) -> None:
    """Restore the method's weights (before the model is wrapped or sharded)."""
    load_weights(folder / ADAPTER_DIR, built)


def load_state(
    folder: Path,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    scaler: Any = None,
    restore_by_name: Callable[[dict[str, Any]], None] | None = None,
    rank: int = 0,
    device: torch.device | None = None,
) -> dict[str, Any]:
    """Restore the optimizer, scheduler and loss scaler; returns the saved extras. An
    optimizer state keyed by parameter name (a sharded run's) goes to ``restore_by_name``;
    a sharded run needs one."""
    state = json.loads((folder / "trainer_state.json").read_text())
    tensors = load_file(str(folder / "optimizer.safetensors"))
    _restore_rng(tensors, rank, device or torch.device("cpu"))
    nested: dict[str, Any] = {}
    for path, value in [*tensors.items(), *state.pop("optimizer_scalars", {}).items()]:
        # checkpoints written before nested states were kept used "{idx}.{name}"
        *parents, leaf = path.split("/") if "/" in path else path.split(".", 1)
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    by_name = state.pop("optimizer_keys", "indices") == "names"
    if by_name != (restore_by_name is not None):
        raise ValueError(
            f"checkpoint at {folder} was written by a "
            f"{'sharded' if by_name else 'replicated'} run and this run is "
            f"{'replicated' if by_name else 'sharded'}: resume with the strategy it had"
        )
    groups = state.pop("param_groups")
    if restore_by_name is not None:
        restore_by_name({"state": nested, "param_groups": groups})
    else:
        opt_state = {int(idx): values for idx, values in nested.items()}
        optimizer.load_state_dict({"state": opt_state, "param_groups": groups})
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
