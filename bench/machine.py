"""The machine a benchmark ran on, for its results: CPU count and model, and whether the
CPU computes bf16 natively for this process (what precision "auto" follows, see
``tunefleet.workers._precision``), which changes both speed and numerics."""

from __future__ import annotations

import os
from pathlib import Path


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def native_bf16() -> tuple[bool, str]:
    """Whether this CPU computes bf16 natively, and what says so (PyTorch and oneDNN)."""
    from tunefleet.workers._precision import cpu_bf16

    return cpu_bf16()


def describe() -> str:
    return f"{os.cpu_count()} CPUs, {cpu_name()} ({native_bf16()[1]})"
