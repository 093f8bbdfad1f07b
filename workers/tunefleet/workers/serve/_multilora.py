"""Many LoRA adapters on one base model, batched together (the S-LoRA / Punica idea).

Every loaded adapter gets a *slot*; slot 0 is the bare base (all zeros). Each targeted
``nn.Linear`` of the base is wrapped by a :class:`BatchedLoraLinear` that keeps the
adapters' low-rank factors stacked, ``A: [slots, in, R]`` and ``B: [slots, R, out]``
(``B`` pre-multiplied by the adapter's scale, ranks zero-padded to the largest loaded
``R``). A forward pass takes one slot per batch row and adds, for the whole batch at once,

    y = base(x) + (x @ A[slot]) @ B[slot]          (per row)

with no loop over adapters: while decoding (one token per row) as two ``embedding_bag``
calls that read each row's factors in place (the BGMV kernel of Punica, on the CPU's
embedding kernels); for a prefill (many tokens per row) as a gather and two batched
matrix products. A batch whose rows all use one adapter takes two plain matrix products.

:class:`~tunefleet.workers.serve._adapter_cache.AdapterCache` decides what holds a slot;
``adapters`` reads adapter folders and the base; ``onednn`` packs the base's frozen
linear layers.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tunefleet.workers.serve._adapters import AdapterError
from tunefleet.workers.serve._onednn import PackedLinear, pack_linear


@dataclass
class _Rows:
    """Which slot each row of the batch being computed uses (set by the engine), and the
    gather indices derived from it, computed once per batch and shared by every layer."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # the model's
    slots: torch.Tensor | None = None  # LongTensor [batch]
    uniform: int | None = None  # the one slot of every row, when they share it
    _bags: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def set(self, slots: list[int] | None) -> None:
        self._bags = {}
        if slots is None:
            self.slots, self.uniform = None, None
            return
        self.slots = torch.tensor(slots, dtype=torch.long, device=self.device)
        first = slots[0]
        self.uniform = first if all(s == first for s in slots) else None

    def bags(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``embedding_bag`` indices and offsets that pick, for row b, the ``width`` rows
        ``slot_b * width ... slot_b * width + width - 1`` of a ``[slots * width, n]`` table."""
        if width not in self._bags:
            assert self.slots is not None
            arange = partial(torch.arange, device=self.slots.device)
            rows = (self.slots[:, None] * width + arange(width)).reshape(-1)
            offsets = arange(len(self.slots)) * width
            self._bags[width] = (rows, offsets)
        return self._bags[width]


class BatchedLoraLinear(nn.Module):
    """A base linear layer plus the stacked LoRA factors of every loaded adapter, stored
    ``A: [slots, in, R]`` and ``B: [slots, R, out]`` (B scaled)."""

    def __init__(self, base: nn.Module, rows: _Rows, slots: int):
        super().__init__()
        linear: Any = base  # nn.Linear, or bitsandbytes' Linear4bit on a 4-bit base
        self.base = base
        self.rows = rows
        self.in_features: int = linear.in_features
        self.out_features: int = linear.out_features
        zeros = partial(torch.zeros, device=rows.device)  # fp32 factors, on the model's device
        self.A = zeros(slots, self.in_features, 0)
        self.B = zeros(slots, 0, self.out_features)

    def resize(self, slots: int, rank: int) -> None:
        """Grow the stacks to ``slots`` x ``rank`` (zero padding keeps every product)."""
        old_s, old_r = self.A.shape[0], self.A.shape[2]
        if (slots, rank) == (old_s, old_r):
            return
        a = self.A.new_zeros(slots, self.in_features, rank)
        b = self.B.new_zeros(slots, rank, self.out_features)
        keep_s, keep_r = min(slots, old_s), min(rank, old_r)
        a[:keep_s, :, :keep_r] = self.A[:keep_s, :, :keep_r]
        b[:keep_s, :keep_r] = self.B[:keep_s, :keep_r]
        self.A, self.B = a, b

    def write(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Put one adapter's factors (peft's ``a: [r, in]`` and scaled ``b: [out, r]``) in
        a slot; None clears the slot (the adapter does not target this layer)."""
        self.A[slot].zero_()
        self.B[slot].zero_()
        if a is not None and b is not None:
            r = a.shape[0]
            self.A[slot, :, :r] = a.T
            self.B[slot, :r] = b.T

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.base(x)
        rows = self.rows
        rank = self.A.shape[2]
        if rows.slots is None or rank == 0 or rows.uniform == 0:
            return y
        if rows.uniform is not None:
            s = rows.uniform
            return y + ((x.to(self.A.dtype) @ self.A[s]) @ self.B[s]).to(y.dtype)
        batch, width = rows.slots.shape[0], x.shape[-1]
        flat = x.reshape(batch, -1, width).to(self.A.dtype)
        if flat.shape[1] == 1:
            # Decoding, one token per row: x_b @ A[slot_b] as a weighted sum of the rows of
            # A[slot_b] (embedding_bag reads them in place, no gathered copy), the same
            # again for B. Rows of the base (slot 0) read zeros.
            idx, off = rows.bags(width)
            xa = F.embedding_bag(
                idx, self.A.view(-1, rank), off, mode="sum", per_sample_weights=flat.reshape(-1)
            )
            idx, off = rows.bags(rank)
            delta = F.embedding_bag(
                idx,
                self.B.view(-1, self.out_features),
                off,
                mode="sum",
                per_sample_weights=xa.reshape(-1),
            )
        else:
            # Prefill, many tokens per row: one small matrix product per row, batched.
            a = self.A.index_select(0, rows.slots)  # [batch, in, R]
            b = self.B.index_select(0, rows.slots)  # [batch, R, out]
            delta = torch.bmm(torch.bmm(flat, a), b)
        return y + delta.reshape(*x.shape[:-1], -1).to(y.dtype)


class MultiLoraModel:
    """A base causal LM whose linear layers take per-row adapters."""

    def __init__(self, model: nn.Module, *, max_adapters: int, pack_weights: bool = True):
        self.model = model
        self.max_adapters = max_adapters
        self.rows = _Rows(device=next(model.parameters()).device)
        self.layers: dict[str, BatchedLoraLinear] = {}
        self.rank = 0
        self.slots = 1 + min(max_adapters, 4)  # grows by doubling up to max_adapters + 1
        self.lock = threading.RLock()  # forward passes and slot writes
        self.packed: dict[str, PackedLinear] = {}
        if pack_weights:
            self._pack()

    def _pack(self) -> None:
        """Put a ``PackedLinear`` in place of every linear layer that can be packed."""
        model: Any = self.model
        head = model.get_output_embeddings()
        embeddings = model.get_input_embeddings()
        tied = head is not None and embeddings is not None and head.weight is embeddings.weight
        for name, module in list(model.named_modules()):
            packed = pack_linear(module, tied=tied and module is head)
            if packed is None:
                continue
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, packed)
            self.packed[name] = packed

    def _layer(self, name: str) -> BatchedLoraLinear:
        """The wrapper of module ``name``, wrapping it on first use."""
        if name in self.layers:
            return self.layers[name]
        parent_name, _, child = name.rpartition(".")
        try:
            parent = self.model.get_submodule(parent_name) if parent_name else self.model
        except AttributeError:
            parent = None
        base = getattr(parent, child, None)
        if base is None or not hasattr(base, "in_features"):
            raise AdapterError(
                f"adapter targets {name!r}, which is not a linear layer of this base model"
            )
        layer = BatchedLoraLinear(base, self.rows, self.slots)
        layer.resize(self.slots, self.rank)
        setattr(parent, child, layer)
        self.layers[name] = layer
        return layer

    def write(self, slot: int, parts: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        with self.lock:
            for name, (a, b) in parts.items():
                layer = self._layer(name)
                if a.shape[1] != layer.in_features or b.shape[0] != layer.out_features:
                    raise AdapterError(
                        f"adapter's {name} is {b.shape[0]}x{a.shape[1]}, the base model's "
                        f"is {layer.out_features}x{layer.in_features}: trained for "
                        "another base model"
                    )
            rank = max(self.rank, *(a.shape[0] for a, _ in parts.values()))
            slots = self.slots
            while slot >= slots:
                slots = min(2 * slots, self.max_adapters + 1)
            if (rank, slots) != (self.rank, self.slots):
                self.rank, self.slots = rank, slots
                for layer in self.layers.values():
                    layer.resize(slots, rank)
            for name, layer in self.layers.items():
                layer.write(slot, *parts.get(name, (None, None)))

    def base_copy(self) -> nn.Module:
        """A plain deep copy of the base model: no adapter layers, weights unpacked (for
        merging)."""
        with self.lock:
            memo: dict[int, Any] = {}  # shared, so tied weights stay tied in the copy
            for packed in self.packed.values():
                memo[id(packed)] = packed.unpacked(memo)
            for wrapper in self.layers.values():
                memo[id(wrapper)] = copy.deepcopy(wrapper.base, memo)
            return copy.deepcopy(self.model, memo)

    def clear(self, slot: int) -> None:
        with self.lock:
            for layer in self.layers.values():
                layer.write(slot, None, None)

    def set_rows(self, slots: list[int] | None) -> None:
        """The adapter slot of each row of the next forward passes (None: no adapters)."""
        self.rows.set(slots)
