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

:class:`AdapterCache` decides what holds a slot: adapters load on demand from their peft
folder (safetensors only), the least recently used unpinned adapter with no request in
flight is evicted when the slots are full, and pinned adapters stay.
"""

from __future__ import annotations

import copy
import json
import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from tunefleet.platform.artifacts import METHOD_FILE
from tunefleet.workers.nf4 import load_4bit

_PEFT_PREFIX = "base_model.model."


class AdapterError(ValueError):
    """An adapter this server cannot serve; the message names it and says why."""


class CacheFullError(RuntimeError):
    """Every slot holds a pinned adapter or one with requests in flight."""


class AdapterInUse(RuntimeError):
    """The adapter cannot be unloaded: requests are using it."""


@dataclass
class _Rows:
    """Which slot each row of the batch being computed uses (set by the engine), and the
    gather indices derived from it, computed once per batch and shared by every layer."""

    slots: torch.Tensor | None = None  # LongTensor [batch]
    uniform: int | None = None  # the one slot of every row, when they share it
    _bags: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def set(self, slots: list[int] | None) -> None:
        self._bags = {}
        if slots is None:
            self.slots, self.uniform = None, None
            return
        self.slots = torch.tensor(slots, dtype=torch.long)
        first = slots[0]
        self.uniform = first if all(s == first for s in slots) else None

    def bags(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``embedding_bag`` indices and offsets that pick, for row b, the ``width`` rows
        ``slot_b * width ... slot_b * width + width - 1`` of a ``[slots * width, n]`` table."""
        if width not in self._bags:
            assert self.slots is not None
            rows = (self.slots[:, None] * width + torch.arange(width)).reshape(-1)
            offsets = torch.arange(len(self.slots)) * width
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
        self.A = torch.zeros(slots, self.in_features, 0)
        self.B = torch.zeros(slots, 0, self.out_features)

    def resize(self, slots: int, rank: int) -> None:
        """Grow the stacks to ``slots`` x ``rank`` (zero padding keeps every product)."""
        old_s, old_r = self.A.shape[0], self.A.shape[2]
        if (slots, rank) == (old_s, old_r):
            return
        a = torch.zeros(slots, self.in_features, rank)
        b = torch.zeros(slots, rank, self.out_features)
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
            return y + (x.to(self.A.dtype) @ self.A[s]) @ self.B[s]
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


# Rows a decode step is expected to have: oneDNN picks the packed layout for it (any
# number of rows works).
PACK_ROWS_HINT = 64


class PackedLinear(nn.Module):
    """A frozen CPU ``nn.Linear`` whose weight oneDNN reorders once into its blocked
    layout (what inductor does when it freezes a CPU model), instead of MKL's sgemm packing
    it again at every call. For the few rows of a decode step that packing costs about as
    much as the product: on SmolLM2 with 2 cores, 128 rows, 50-58 -> 62-69 GFLOP/s for the
    decoder's layers and 151 -> 99 ms for the 49,152-row output layer. A row's result is
    also the same bits whatever the other rows of the batch (MKL's is not).

    Only the packed weight is kept, except where the weight is shared with another module
    (tied embeddings), which holds it anyway."""

    def __init__(self, linear: nn.Linear, packed: torch.Tensor, tied: bool):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.packed = packed
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.tied = linear if tied else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x, self.packed, self.bias, "none", [], ""
        )
        return out

    def unpacked(self, memo: dict[int, Any]) -> nn.Linear:
        """A plain ``nn.Linear`` with the same weights (a tied one stays tied through
        ``memo``, the memo of a ``deepcopy`` of the whole model)."""
        if self.tied is not None:
            linear: nn.Linear = copy.deepcopy(self.tied, memo)
            return linear
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        linear.weight = nn.Parameter(self.packed.to_dense(), requires_grad=False)
        if self.bias is not None:
            linear.bias = nn.Parameter(self.bias.clone(), requires_grad=False)
        return linear


def pack_linear(linear: nn.Module, tied: bool = False) -> PackedLinear | None:
    """``linear`` packed for oneDNN, or None where it cannot be: not a plain fp32
    ``nn.Linear`` on the CPU, oneDNN missing, or its product differing from
    ``F.linear``'s (checked on a random input)."""
    if type(linear) is not nn.Linear or not torch.backends.mkldnn.is_available():
        return None
    weight = linear.weight.detach()
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    try:
        packed = PackedLinear(
            linear, torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT), tied
        )
        x = torch.randn(3, linear.in_features, generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            ok = torch.allclose(packed(x), linear(x), rtol=1e-4, atol=1e-4)
    except (RuntimeError, AttributeError):  # an op missing from this build of torch
        return None
    return packed if ok else None


@dataclass
class LoadedAdapter:
    adapter_id: str
    slot: int
    rank: int
    modules: int
    load_s: float


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


def load_serving_base(model_path: str | Path, quantization: str = "none") -> nn.Module:
    """The base model for serving, in fp32 or quantized to 4-bit NF4 (double quantization,
    fp32 compute on every CPU: ``nf4.load_4bit``) to serve QLoRA adapters on the base they
    were trained on."""
    from transformers import AutoModelForCausalLM

    model: nn.Module
    if quantization == "nf4":
        model = load_4bit(
            str(model_path), quant_type="nf4", double_quant=True, compute_dtype=torch.float32
        )
    elif quantization == "none":
        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    else:
        raise ValueError(f"base_quantization {quantization!r}: use 'none' or 'nf4'")
    return model.eval()


@dataclass
class _Entry:
    loaded: LoadedAdapter
    pinned: bool = False
    in_flight: int = 0


class MultiLoraModel:
    """A base causal LM whose linear layers take per-row adapters."""

    def __init__(self, model: nn.Module, *, max_adapters: int, pack_weights: bool = True):
        self.model = model
        self.max_adapters = max_adapters
        self.rows = _Rows()
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


@dataclass
class AdapterCache:
    """Which adapters hold a slot: LRU eviction of unpinned adapters with nothing in
    flight. ``locate(adapter_id)`` gives the adapter's peft folder."""

    lora: MultiLoraModel
    locate: Any  # Callable[[str], Path]
    on_load: Any = None  # Callable[[str], None]
    on_evict: Any = None  # Callable[[str], None]
    _entries: OrderedDict[str, _Entry] = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def capacity(self) -> int:
        return self.lora.max_adapters

    def loaded(self) -> list[dict[str, Any]]:
        with self._lock:
            return [
                {
                    "id": e.loaded.adapter_id,
                    "slot": e.loaded.slot,
                    "rank": e.loaded.rank,
                    "pinned": e.pinned,
                    "in_flight": e.in_flight,
                    "load_ms": round(e.loaded.load_s * 1000, 2),
                }
                for e in self._entries.values()
            ]

    def _free_slot(self) -> int:
        used = {e.loaded.slot for e in self._entries.values()}
        for slot in range(1, self.capacity + 1):
            if slot not in used:
                return slot
        for adapter_id, entry in self._entries.items():  # oldest first
            if not entry.pinned and entry.in_flight == 0:
                del self._entries[adapter_id]
                self.lora.clear(entry.loaded.slot)
                if self.on_evict:
                    self.on_evict(adapter_id)
                return entry.loaded.slot
        raise CacheFullError(
            f"all {self.capacity} adapter slots hold pinned adapters or adapters with "
            "requests in flight; unpin one or raise max_adapters_per_replica"
        )

    def acquire(self, adapter_id: str, *, pin: bool | None = None, hold: bool = True) -> int:
        """The slot of ``adapter_id``, loading it first if needed; with ``hold`` the caller
        has a request in flight and must ``release`` it. The adapter's files are read
        outside the lock: a slow disk holds up no request of a loaded adapter."""
        parts: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
        started = time.perf_counter()
        with self._lock:
            loaded_already = adapter_id in self._entries
        if not loaded_already:
            config, weights = read_adapter(self.locate(adapter_id))
            parts = factors(config, weights)
        with self._lock:
            entry = self._entries.get(adapter_id)
            if entry is None:
                if parts is None:  # evicted meanwhile: read again (rare)
                    parts = factors(*read_adapter(self.locate(adapter_id)))
                slot = self._free_slot()
                self.lora.write(slot, parts)
                rank = max(a.shape[0] for a, _ in parts.values())
                loaded = LoadedAdapter(
                    adapter_id, slot, rank, len(parts), time.perf_counter() - started
                )
                entry = self._entries[adapter_id] = _Entry(loaded)
                if self.on_load:
                    self.on_load(adapter_id)
            self._entries.move_to_end(adapter_id)
            if pin is not None:
                entry.pinned = pin
            entry.in_flight += hold
            return entry.loaded.slot

    def release(self, adapter_id: str) -> None:
        with self._lock:
            entry = self._entries.get(adapter_id)
            if entry is not None and entry.in_flight > 0:
                entry.in_flight -= 1

    def unload(self, adapter_id: str) -> bool:
        """Drop an adapter now; refused while requests use it. False if not loaded."""
        with self._lock:
            entry = self._entries.get(adapter_id)
            if entry is None:
                return False
            if entry.in_flight:
                raise AdapterInUse(
                    f"adapter {adapter_id!r} has {entry.in_flight} request(s) in flight; "
                    "unload it when they finish"
                )
            del self._entries[adapter_id]
            self.lora.clear(entry.loaded.slot)
            return True

    def load_time(self, adapter_id: str) -> float:
        with self._lock:
            return self._entries[adapter_id].loaded.load_s
