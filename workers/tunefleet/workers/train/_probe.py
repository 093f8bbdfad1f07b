"""The seeds' Step 2 on the worker's own device: the largest micro-batch that really runs.

The planner's micro-batch is a prediction; ``search`` tries it with one forward and
backward pass on the longest examples, halves it while that runs out of memory, or doubles
it while it fits, up to the worker's share of the batch. On a GPU "does not fit" is the
out-of-memory error the attempt provokes (caught, the cache emptied, the next size tried).
A CPU has no such error (the kernel kills the process instead), so there the step's peak
resident memory above the worker's memory before the model was built must stay within the
device memory the job's plan was made for.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable
from pathlib import Path

import torch


class NoMicroBatchFits(RuntimeError):
    pass


def search(fits: Callable[[int], bool], start: int, most: int) -> tuple[int, list[int]]:
    """The largest micro-batch ``fits`` accepts, from ``start``: doubling while it fits (up
    to ``most``), else halving until it does. Returns it and the sizes that failed."""
    failed: list[int] = []
    size = max(1, min(start, most))
    if fits(size):
        while size * 2 <= most and fits(size * 2):
            size *= 2
        if size * 2 <= most:
            failed.append(size * 2)
        return size, failed
    failed.append(size)
    while size > 1:
        size //= 2
        if fits(size):
            return size, failed
        failed.append(size)
    raise NoMicroBatchFits(
        "not even a micro-batch of 1 example fits the device: lower tunefleet.max_seq_len, "
        "turn on gradient_checkpointing, or use a sharded strategy (zero3) or qlora"
    )


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def resident_bytes() -> int:
    """This process's resident memory once freed heap pages went back to the system (as
    ``DeviceFit`` measures each attempt): start-up leaves freed pages that would otherwise
    count here and lower every later peak measured against it."""
    name = ctypes.util.find_library("c")
    if name:
        ctypes.CDLL(name).malloc_trim(0)
    return status_kib("VmRSS") * 1024


class DeviceFit:
    """Runs an attempt and says whether it fit the device (see the module's docstring);
    ``baseline`` is the resident memory before the model was built (CPU)."""

    def __init__(self, device: torch.device, budget_bytes: float | None, baseline: int):
        self.device, self.budget, self.baseline = device, budget_bytes, baseline
        name = ctypes.util.find_library("c")
        self._libc = ctypes.CDLL(name) if name else None
        self.peaks: dict[int, int] = {}

    def __call__(self, size: int, attempt: Callable[[], None]) -> bool:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            try:
                attempt()
            except torch.OutOfMemoryError:
                torch.cuda.empty_cache()
                return False
            return True
        if self._libc is not None:
            self._libc.malloc_trim(0)  # freed tensors of a larger attempt leave the RSS
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS mark
        attempt()
        self.peaks[size] = status_kib("VmHWM") * 1024 - self.baseline
        return self.budget is None or self.peaks[size] <= self.budget
