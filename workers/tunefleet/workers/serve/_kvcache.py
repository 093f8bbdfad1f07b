"""The decode batch's KV cache: per layer, preallocated ``[rows, heads, capacity, dim]``
buffers written in place, instead of transformers' ``DynamicCache``, which concatenates
the whole cache to append each token (a copy of every layer's keys and values per step).

Attention reads the full buffers; columns past the written ``length`` are zeros and
masked (transformers pads the engine's 2-D mask with zeros to the width
``get_mask_sizes`` reports). Capacity grows ``GROW`` columns at a time, so a decode step
copies the cache once every ``GROW`` steps and attends over at most ``GROW`` empty
columns. Rows join (``join``, left-padded to a common width) and leave (``select``) the
batch between steps.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

GROW = 16


def _capacity(length: int) -> int:
    """Room for ``length`` columns and at least one more, in whole ``GROW`` blocks."""
    return (length // GROW + 1) * GROW


class GrowingLayer(DynamicLayer):
    """One layer's keys and values; ``length`` columns written, the rest zeros."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states.new_zeros((*key_states.shape[:2], 0, key_states.shape[3]))
        self.values = value_states.new_zeros((*value_states.shape[:2], 0, value_states.shape[3]))
        self.is_initialized = True

    def _room(self, width: int) -> int:
        assert self.keys is not None
        have = self.keys.shape[-2]
        return have if width <= have else _capacity(width)

    def resize(self, capacity: int) -> None:
        """Buffers of ``capacity`` columns holding the written ones."""
        assert self.keys is not None and self.values is not None
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros((*old.shape[:2], capacity, old.shape[3]))
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self.keys is not None and self.values is not None
        end = self.length + key_states.shape[-2]
        if end > self.keys.shape[-2]:
            self.resize(self._room(end))
        self.keys[:, :, self.length : end] = key_states
        self.values[:, :, self.length : end] = value_states
        self.length = end
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """The width of the buffers the coming update returns."""
        if not self.is_initialized:
            return _capacity(query_length), 0
        return self._room(self.length + query_length), 0

    def get_seq_length(self) -> int:
        return self.length


class BatchCache(Cache):
    """The KV cache of the engine's running batch (one ``GrowingLayer`` per layer)."""

    def __init__(self) -> None:
        super().__init__(layer_class_to_replicate=GrowingLayer)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        if layer_idx >= len(self.layers):  # not created yet: the prefill's first update
            return _capacity(query_length), 0
        return super().get_mask_sizes(query_length, layer_idx)

    @property
    def length(self) -> int:
        return self.get_seq_length()

    def _layers(self) -> list[GrowingLayer]:
        layers: list[Any] = self.layers
        return layers

    def join(self, other: BatchCache) -> None:
        """Append ``other``'s rows after this cache's, both right-aligned at the longer
        length (left padding: zeros, masked by the engine's mask)."""
        width = max(self.length, other.length)
        for mine, theirs in zip(self._layers(), other._layers(), strict=True):
            assert mine.keys is not None and theirs.keys is not None
            for name in ("keys", "values"):
                a, b = getattr(mine, name), getattr(theirs, name)
                rows = a.shape[0] + b.shape[0]
                out = a.new_zeros((rows, a.shape[1], _capacity(width), a.shape[3]))
                out[: a.shape[0], :, width - mine.length : width] = a[:, :, : mine.length]
                out[a.shape[0] :, :, width - theirs.length : width] = b[:, :, : theirs.length]
                setattr(mine, name, out)
            mine.length = width

    def select(self, rows: torch.Tensor, first: int = 0) -> None:
        """Keep only ``rows`` (indices), dropping the first ``first`` columns (padding in
        every remaining row)."""
        for layer in self._layers():
            assert layer.keys is not None and layer.values is not None
            length = layer.length - first
            for name in ("keys", "values"):
                old = getattr(layer, name)
                new = old.new_zeros((len(rows), old.shape[1], _capacity(length), old.shape[3]))
                new[:, :, :length] = old[rows, :, first : layer.length]
                setattr(layer, name, new)
            layer.length = length
