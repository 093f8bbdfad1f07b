"""The machine a benchmark ran on, for its results: CPU count and model, and whether the
CPU computes bf16 natively (AVX-512 BF16 or AMX), which changes both speed and numerics."""

from __future__ import annotations

import os
from pathlib import Path


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def native_bf16() -> bool:
    flags = Path("/proc/cpuinfo").read_text()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def describe() -> str:
    bf16 = "native bf16" if native_bf16() else "no native bf16"
    return f"{os.cpu_count()} CPUs, {cpu_name()} ({bf16})"
