"""Many LoRA adapters on one base model, batched together (the S-LoRA / Punica idea).

Every loaded adapter gets a *slot* (a handle; slot 0 is the bare base). Each targeted
``nn.Linear`` of the base is wrapped by a :class:`BatchedLoraLinear` that keeps the
adapters' low-rank factors stacked by *rank bucket*: an adapter of rank r lives in the
stack of width R = the next power of two (8 in the 8 stack, 12 in the 16 one), ``A: [n,
in, R]`` and ``B: [n, R, out]`` (``B`` pre-multiplied by the adapter's scale, zero-padded
from r to R). Adapters of rank 8 and 256 sit side by side, each padded at most to twice
its rank and not at all for the usual powers of two. A forward pass takes one slot per
batch row and adds, for every bucket the batch uses, to the rows using it

    y = base(x) + (x @ A[slot]) @ B[slot]          (per row)

with no loop over adapters: while decoding (one token per row) as two ``embedding_bag``
calls that read each row's factors in place (the BGMV kernel of Punica, on the CPU's
embedding kernels); for a prefill (many tokens per row) as two batched matrix products,
over the whole stack where it is small beside the rows on it, else over each row's
gathered factors. A batch whose rows all use one adapter takes two plain matrix products.
The deltas are added into the base layer's own output, in place.

What the stacks hold is counted in bytes (:meth:`MultiLoraModel.used_bytes`, against an
optional budget their allocation never exceeds); :class:`~tunefleet.workers.serve.
_adapter_cache.AdapterCache` decides what holds a slot; ``adapters`` reads adapter
folders and the base; ``onednn`` packs the base's frozen linear layers.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tunefleet.workers.serve._adapters import AdapterError
from tunefleet.workers.serve._onednn import PackedLinear, pack_linear

FACTOR_BYTES = 4  # the stacks are float32, whatever the base's precision


def bucket_of(rank: int) -> int:
    """The width of the stack an adapter of ``rank`` goes into: the next power of two."""
    return 1 << (rank - 1).bit_length()


@dataclass
class _Group:
    """The rows of a batch whose adapters share one rank bucket."""

    rank: int  # the bucket's width
    positions: torch.Tensor | None  # LongTensor: the rows in the batch (None: all of them)
    index: torch.Tensor  # LongTensor: each such row's place in the bucket's stack
    order: torch.Tensor  # LongTensor: each row's rank among the group's rows on its place
    most: int  # the most rows on one place
    _bags: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def bags(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``embedding_bag`` indices and offsets that pick, for row b, the ``width`` rows
        ``index_b * width ... index_b * width + width - 1`` of a ``[n * width, k]`` table."""
        if width not in self._bags:
            arange = partial(torch.arange, device=self.index.device)
            rows = (self.index[:, None] * width + arange(width)).reshape(-1)
            offsets = arange(len(self.index)) * width
            self._bags[width] = (rows, offsets)
        return self._bags[width]


@dataclass
class _Rows:
    """Which adapter each row of the batch being computed uses (set by the engine), as
    groups by rank bucket, computed once per batch and shared by every layer."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # the model's
    active: bool = False  # a batch is set
    size: int = 0  # its rows
    uniform: tuple[int, int] | None = None  # (bucket, place) of every row, when they share it
    groups: list[_Group] = field(default_factory=list)

    def set(self, places: list[tuple[int, int] | None] | None) -> None:
        """Each row's (bucket, place in its stack), None for the bare base; None: no batch."""
        self.uniform, self.groups = None, []
        self.active = places is not None
        self.size = len(places or ())
        if not places:
            return
        first = places[0]
        if first is not None and all(p == first for p in places):
            self.uniform = first
            return
        by_rank: dict[int, tuple[list[int], list[int], list[int]]] = {}
        seen: dict[tuple[int, int], int] = {}  # rows so far on each (bucket, place)
        for row, place in enumerate(places):
            if place is not None:
                positions, index, order = by_rank.setdefault(place[0], ([], [], []))
                positions.append(row)
                index.append(place[1])
                order.append(seen.get(place, 0))
                seen[place] = order[-1] + 1
        tensor = partial(torch.tensor, dtype=torch.long, device=self.device)
        for rank, (positions, index, order) in sorted(by_rank.items()):
            every = len(positions) == len(places)
            self.groups.append(
                _Group(
                    rank,
                    None if every else tensor(positions),
                    tensor(index),
                    tensor(order),
                    max(order) + 1,
                )
            )


class BatchedLoraLinear(nn.Module):
    """A base linear layer plus the stacked LoRA factors of every loaded adapter, one
    stack per rank bucket R: ``A: [n, in, R]`` and ``B: [n, R, out]`` (B scaled)."""

    def __init__(self, base: nn.Module, rows: _Rows):
        super().__init__()
        linear: Any = base  # nn.Linear, or bitsandbytes' Linear4bit on a 4-bit base
        self.base = base
        self.rows = rows
        self.in_features: int = linear.in_features
        self.out_features: int = linear.out_features
        self.stacks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def width(self) -> int:
        """Factor elements per unit of rank: a rank-R place holds ``R * width`` of them."""
        return self.in_features + self.out_features

    def resize(self, rank: int, places: int) -> None:
        """Make the ``rank`` stack ``places`` deep, keeping the places below (0: drop it)."""
        old_a, old_b = self.stacks.get(rank, (None, None))
        if places == 0:
            self.stacks.pop(rank, None)
            return
        if old_a is not None and old_a.shape[0] == places:
            return
        zeros = partial(torch.zeros, device=self.rows.device)  # fp32, on the model's device
        a = zeros(places, self.in_features, rank)
        b = zeros(places, rank, self.out_features)
        if old_a is not None and old_b is not None:
            keep = min(places, old_a.shape[0])
            a[:keep], b[:keep] = old_a[:keep], old_b[:keep]
        self.stacks[rank] = (a, b)

    def move(self, rank: int, src: int, dst: int) -> None:
        a, b = self.stacks[rank]
        a[dst], b[dst] = a[src], b[src]

    def write(self, rank: int, place: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Put one adapter's factors (peft's ``a: [r, in]`` and scaled ``b: [out, r]``) in
        a place of the ``rank`` stack; None writes zeros (the adapter does not target this
        layer)."""
        stack_a, stack_b = self.stacks[rank]
        stack_a[place].zero_()
        stack_b[place].zero_()
        if a is not None and b is not None:
            r = a.shape[0]
            stack_a[place, :, :r] = a.T
            stack_b[place, :r] = b.T

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.base(x)
        rows = self.rows
        if not rows.active or not self.stacks:
            return y
        if rows.uniform is not None:
            rank, place = rows.uniform
            a, b = self.stacks[rank]
            y += ((x.to(a.dtype) @ a[place]) @ b[place]).to(y.dtype)
            return y
        if not rows.groups:  # every row is the bare base
            return y
        batch = rows.size
        flat = x.reshape(batch, -1, self.in_features).to(torch.float32)
        out = y.reshape(batch, -1, self.out_features)  # the base's own result: added to
        for group in rows.groups:
            mine = flat if group.positions is None else flat.index_select(0, group.positions)
            delta = self._delta(mine, group).to(out.dtype)
            if group.positions is None:
                out += delta
            else:
                out.index_add_(0, group.positions, delta)
        return out.view(y.shape)

    def _delta(self, flat: torch.Tensor, group: _Group) -> torch.Tensor:
        """``(x_b @ A[place_b]) @ B[place_b]`` for the rows ``flat: [n, tokens, in]`` of
        one bucket: ``[n, tokens, out]``."""
        a, b = self.stacks[group.rank]
        rank = group.rank
        places = a.shape[0]
        tokens = flat.shape[1]
        if tokens > 1 and places * group.most <= 2 * len(group.index):
            # A prefill on a stack that is small beside the rows on it: multiply every
            # place's factors at once, each place's rows side by side in a zero-padded
            # grid. This reads each adapter's factors once, not once per row, and copies
            # none of them; the padding costs at most as much work again. (While decoding
            # the grid's scatter and gather cost more, on the CPUs measured, than the
            # second read embedding_bag makes of an adapter two rows share.)
            grid = flat.new_zeros(places, group.most, *flat.shape[1:])
            grid[group.index, group.order] = flat
            out = torch.bmm(torch.bmm(grid.view(places, -1, self.in_features), a), b)
            out = out.view(places, group.most, tokens, self.out_features)
            return out[group.index, group.order]
        if tokens == 1:
            # Decoding, one token per row: x_b @ A[place_b] as a weighted sum of the rows
            # of A[place_b] (embedding_bag reads them in place, no gathered copy), the
            # same again for B.
            idx, off = group.bags(self.in_features)
            xa = F.embedding_bag(
                idx, a.view(-1, rank), off, mode="sum", per_sample_weights=flat.reshape(-1)
            )
            idx, off = group.bags(rank)
            delta = F.embedding_bag(
                idx,
                b.view(-1, self.out_features),
                off,
                mode="sum",
                per_sample_weights=xa.reshape(-1),
            )
            return delta.unsqueeze(1)
        # Prefill, many tokens per row: one small matrix product per row, batched.
        index = group.index
        return torch.bmm(torch.bmm(flat, a.index_select(0, index)), b.index_select(0, index))


class MultiLoraModel:
    """A base causal LM whose linear layers take per-row adapters.

    ``budget_bytes`` (None: unbounded) bounds what the factor stacks allocate; the cache
    makes room (:meth:`cost`, :meth:`used_bytes`) before it writes an adapter, and a write
    trims the stacks' spare places before it would allocate past the budget."""

    def __init__(
        self,
        model: nn.Module,
        *,
        max_adapters: int,
        budget_bytes: int | None = None,
        pack_weights: bool = True,
    ):
        self.model = model
        self.max_adapters = max_adapters
        self.budget_bytes = budget_bytes
        self.rows = _Rows(device=next(model.parameters()).device)
        self.layers: dict[str, BatchedLoraLinear] = {}
        self.where: dict[int, tuple[int, int]] = {}  # slot -> (bucket, place in its stack)
        self.depth: dict[int, int] = {}  # bucket -> places allocated
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

    # -- bytes ----------------------------------------------------------------------------
    @property
    def width(self) -> int:
        """Factor elements per unit of rank of one slot, over every wrapped layer."""
        return sum(layer.width for layer in self.layers.values())

    def _ranks(self, slots: Iterable[int] | None) -> int:
        where = self.where if slots is None else {s: self.where[s] for s in slots}
        return sum(rank for rank, _ in where.values())

    def used_bytes(self, slots: Iterable[int] | None = None) -> int:
        """What the loaded adapters' places hold (those of ``slots``: all by default)."""
        return self._ranks(slots) * self.width * FACTOR_BYTES

    def slot_bytes(self, slot: int) -> int:
        """What ``slot``'s place holds: its bucket's width over every wrapped layer."""
        return self.where[slot][0] * self.width * FACTOR_BYTES

    def allocated_bytes(self) -> int:
        """What the stacks hold, spare places included."""
        return sum(r * n for r, n in self.depth.items()) * self.width * FACTOR_BYTES

    def cost(
        self,
        parts: dict[str, tuple[torch.Tensor, torch.Tensor]],
        slots: Iterable[int] | None = None,
    ) -> int:
        """By how much loading these factors raises :meth:`used_bytes`, were only ``slots``
        loaded (all by default; none: ``[]``): the adapter's own place, plus the layers it
        targets that no adapter did before, for each of those slots."""
        new = sum(sum(self._shape(name)) for name in parts if name not in self.layers)
        rank = bucket_of(max(a.shape[0] for a, _ in parts.values()))
        return (rank * (self.width + new) + self._ranks(slots) * new) * FACTOR_BYTES

    # -- layers ---------------------------------------------------------------------------
    def _module(self, name: str) -> tuple[Any, str, Any]:
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
        return parent, child, base

    def _shape(self, name: str) -> tuple[int, int]:
        """(in, out) features of module ``name``."""
        layer = self.layers.get(name) or self._module(name)[2]
        return layer.in_features, layer.out_features

    def _layer(self, name: str) -> BatchedLoraLinear:
        """The wrapper of module ``name``, wrapping it on first use."""
        if name in self.layers:
            return self.layers[name]
        parent, child, base = self._module(name)
        layer = BatchedLoraLinear(base, self.rows)
        for rank, places in self.depth.items():
            layer.resize(rank, places)
        setattr(parent, child, layer)
        self.layers[name] = layer
        return layer

    # -- places ---------------------------------------------------------------------------
    def _resize(self, rank: int, places: int) -> None:
        for layer in self.layers.values():
            layer.resize(rank, places)
        if places:
            self.depth[rank] = places
        else:
            self.depth.pop(rank, None)

    def _trim(self) -> None:
        """Drop every spare place: move each bucket's places to its front, then shrink its
        stacks to them."""
        for rank in list(self.depth):
            mine = sorted((place, slot) for slot, (r, place) in self.where.items() if r == rank)
            for new, (old, slot) in enumerate(mine):
                if old != new:
                    for layer in self.layers.values():
                        layer.move(rank, old, new)
                    self.where[slot] = (rank, new)
            self._resize(rank, len(mine))

    def _place(self, rank: int) -> int:
        """A free place in the ``rank`` stack, growing it (doubling, within the budget)."""
        taken = {place for r, place in self.where.values() if r == rank}
        depth = self.depth.get(rank, 0)
        free = next((p for p in range(depth) if p not in taken), None)
        if free is not None:
            return free
        per_place = rank * self.width * FACTOR_BYTES
        grow = max(depth, 1)
        if self.budget_bytes is not None:
            if self.allocated_bytes() + per_place > self.budget_bytes:
                self._trim()
                depth = self.depth.get(rank, 0)
            room = (self.budget_bytes - self.allocated_bytes()) // max(per_place, 1)
            grow = max(1, min(grow, room))
        self._resize(rank, depth + grow)
        return depth

    def write(self, slot: int, parts: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Load one adapter's factors into ``slot`` (replacing what it held)."""
        with self.lock:
            for name, (a, b) in parts.items():
                n_in, n_out = self._shape(name)
                if a.shape[1] != n_in or b.shape[0] != n_out:
                    raise AdapterError(
                        f"adapter's {name} is {b.shape[0]}x{a.shape[1]}, the base model's "
                        f"is {n_out}x{n_in}: trained for another base model"
                    )
            self.clear(slot)
            if any(name not in self.layers for name in parts):
                if self.budget_bytes is not None:
                    self._trim()  # a new layer gets a copy of every stack: no spare places
                for name in parts:
                    self._layer(name)
            rank = bucket_of(max(a.shape[0] for a, _ in parts.values()))
            place = self._place(rank)
            self.where[slot] = (rank, place)
            for name, layer in self.layers.items():
                layer.write(rank, place, *parts.get(name, (None, None)))

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
        """Free ``slot``'s place (its stack keeps the place, spare, for the next load)."""
        with self.lock:
            self.where.pop(slot, None)

    def factors(self, slot: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``slot``'s place in layer ``name``'s stacks: ``A: [in, R]``, ``B: [R, out]``."""
        rank, place = self.where[slot]
        a, b = self.layers[name].stacks[rank]
        return a[place], b[place]

    def set_rows(self, slots: list[int] | None) -> None:
        """The adapter slot of each row of the next forward passes (0: the bare base;
        None: no adapters)."""
        if slots is None:
            self.rows.set(None)
        else:
            self.rows.set([self.where[s] if s else None for s in slots])
