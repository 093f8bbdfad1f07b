"""Which adapters hold a slot of a replica's batched model: loaded on demand from their
folder; when the slots are full, or the adapter memory budget would be passed, the least
recently used unpinned adapters with no request in flight are evicted until the new one
fits, by its bytes (its rank bucket times its targets' sizes); pinned adapters are kept.
An adapter larger than the whole budget is refused (:class:`AdapterTooLarge`)."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from tunefleet.workers.serve._adapters import AdapterError, factors, read_adapter
from tunefleet.workers.serve._multilora import MultiLoraModel


class CacheFullError(RuntimeError):
    """Every slot holds a pinned adapter or one with requests in flight."""


class AdapterTooLarge(AdapterError):
    """The adapter alone needs more adapter memory than a replica has."""

    code = "adapter_too_large"


class AdapterInUse(RuntimeError):
    """The adapter cannot be unloaded: requests are using it."""


@dataclass
class LoadedAdapter:
    adapter_id: str
    slot: int
    rank: int
    modules: int
    load_s: float


@dataclass
class _Entry:
    loaded: LoadedAdapter
    pinned: bool = False
    in_flight: int = 0


@dataclass
class AdapterCache:
    """Which adapters hold a slot: LRU eviction of unpinned adapters with nothing in
    flight. ``locate(adapter_id)`` gives the adapter's peft folder."""

    lora: MultiLoraModel
    locate: Any  # Callable[[str], Path]
    on_load: Any = None  # Callable[[str], None]
    on_evict: Any = None  # Callable[[str], None]
    on_unload: Any = None  # Callable[[str], None]: after an eviction or an unload
    _entries: OrderedDict[str, _Entry] = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def capacity(self) -> int:
        return self.lora.max_adapters

    def __contains__(self, adapter_id: str) -> bool:
        return adapter_id in self._entries

    def loaded(self) -> list[dict[str, Any]]:
        with self._lock:
            return [
                {
                    "id": e.loaded.adapter_id,
                    "slot": e.loaded.slot,
                    "rank": e.loaded.rank,
                    "bytes": self.lora.slot_bytes(e.loaded.slot),
                    "pinned": e.pinned,
                    "in_flight": e.in_flight,
                    "load_ms": round(e.loaded.load_s * 1000, 2),
                }
                for e in self._entries.values()
            ]

    def memory(self) -> dict[str, int | None]:
        """The adapter memory budget, what the loaded adapters use and what is allocated."""
        with self._lock:
            return {
                "budget_bytes": self.lora.budget_bytes,
                "used_bytes": self.lora.used_bytes(),
                "allocated_bytes": self.lora.allocated_bytes(),
            }

    def _evict_oldest(self) -> bool:
        for adapter_id, entry in self._entries.items():  # oldest first
            if not entry.pinned and entry.in_flight == 0:
                del self._entries[adapter_id]
                self.lora.clear(entry.loaded.slot)
                if self.on_evict:
                    self.on_evict(adapter_id)
                if self.on_unload:
                    self.on_unload(adapter_id)
                return True
        return False

    def _make_room(self, adapter_id: str, parts: dict[str, Any]) -> int:
        """A free slot with room in the budget for ``parts``, evicting LRU adapters; none
        is evicted unless that makes room."""
        lora, budget = self.lora, self.lora.budget_bytes
        if budget is not None and lora.cost(parts, []) > budget:
            rank = max(a.shape[0] for a, _ in parts.values())
            raise AdapterTooLarge(
                f"its rank {rank} over {len(parts)} modules needs {_mb(lora.cost(parts, []))} "
                f"of adapter memory, more than the {_mb(budget)} a replica has "
                "(serve_adapter_memory)"
            )

        def fits(slots: list[int] | None = None) -> bool:
            return budget is None or lora.used_bytes(slots) + lora.cost(parts, slots) <= budget

        stay = [e.loaded.slot for e in self._entries.values() if e.pinned or e.in_flight]
        if len(stay) >= self.capacity or not fits(stay):
            why = (
                f"all {self.capacity} adapter slots hold"
                if len(stay) >= self.capacity
                else f"{_mb(lora.used_bytes(stay))} of the {_mb(budget or 0)} of adapter "
                f"memory (this adapter needs {_mb(lora.cost(parts, stay))}) are held by"
            )
            raise CacheFullError(
                f"{why} pinned adapters or adapters with requests in flight; unpin one or "
                "raise max_adapters_per_replica or serve_adapter_memory"
            )
        while True:
            used = {e.loaded.slot for e in self._entries.values()}
            free = next((s for s in range(1, self.capacity + 1) if s not in used), None)
            if free is not None and fits():
                return free
            if not self._evict_oldest():  # cannot be: what stays fits, checked above
                raise RuntimeError(f"no room for adapter {adapter_id!r} after evicting all")

    def acquire(self, adapter_id: str, *, pin: bool | None = None, hold: bool = True) -> int:
        """The slot of ``adapter_id``, loading it first if needed; with ``hold`` the caller
        has a request in flight and must ``release`` it. The adapter's files are read
        outside the lock: a slow disk holds up no request of a loaded adapter."""
        try:
            return self._acquire(adapter_id, pin, hold)
        except BaseException:
            # a load that failed after its files were located: what locating held (the
            # copy's pin in the node cache) is let go
            with self._lock:
                loaded = adapter_id in self._entries
            if not loaded and self.on_unload:
                self.on_unload(adapter_id)
            raise

    def _acquire(self, adapter_id: str, pin: bool | None, hold: bool) -> int:
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
                slot = self._make_room(adapter_id, parts)
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
            if self.on_unload:
                self.on_unload(adapter_id)
            return True

    def load_time(self, adapter_id: str) -> float:
        with self._lock:
            return self._entries[adapter_id].loaded.load_s


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
