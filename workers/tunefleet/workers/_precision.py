"""What ``tunefleet.precision: auto`` becomes on a run's workers: bf16 where the device
computes it natively, fp16 (with loss scaling) on GPUs without bf16, fp32 elsewhere
(``spec.AUTO_PRECISION``). Only a worker sees its device, so the workers settle it at
start, and a gang trains in the lowest precision all its workers have. Serving replicas
settle ``TUNEFLEET_SERVE_PRECISION=auto`` by the same rule (``serve._adapters``).

A CPU computes bf16 natively when PyTorch's cpuinfo reports AMX or AVX512-BF16 *and*
oneDNN, which runs PyTorch's bf16 GEMMs on the CPU, may use those instructions: an
``ONEDNN_MAX_CPU_ISA`` below ``AVX512_CORE_BF16`` keeps it off them (measured on an
AVX512-BF16 EPYC: bf16 GEMMs at 975 GFLOP/s, 4.4x fp32; capped at ``AVX512_CORE`` they are
emulated at 176, below fp32's 222; capped at ``AVX2``, 5). Without native bf16 a CPU
trains in fp32, never in an emulated 16-bit type."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

# oneDNN's ISA names (``ONEDNN_MAX_CPU_ISA``, oneDNN 3.x) from which its kernels use bf16 dot
# products (AVX512-BF16, AMX); lower caps emulate bf16, and an unknown name counts as lower
ONEDNN_BF16_ISAS = frozenset(
    {
        "AVX512_CORE_BF16", "AVX10_1_512", "AVX512_CORE_FP16", "AVX10_1_512_AMX",
        "AVX512_CORE_AMX", "AVX10_1_512_AMX_FP16", "AVX512_CORE_AMX_FP16", "AVX10_2_512",
        "AVX10_2_512_AMX_2", "DEFAULT", "ALL",
    }
)  # fmt: skip
# a gang trains in the lowest its workers chose: fp16 runs on every GPU that has bf16
ORDER = ("fp32", "fp16", "bf16")


def cpu_bf16() -> tuple[bool, str]:
    """Whether this process's CPU computes bf16 natively, and what says so."""
    units = [
        name
        for name, has in (
            ("AMX", torch.cpu._is_amx_tile_supported()),
            ("AVX512-BF16", torch.cpu._is_avx512_bf16_supported()),
        )
        if has
    ]
    if not units:
        return False, "this CPU has neither AMX nor AVX512-BF16 (PyTorch's cpuinfo)"
    have = " and ".join(units)
    for var in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        cap = os.environ.get(var)
        if cap and cap.upper() not in ONEDNN_BF16_ISAS:
            return False, (
                f"this CPU has {have}, but {var}={cap} keeps oneDNN's kernels below them "
                "(bf16 would be emulated)"
            )
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False, f"this CPU has {have}, but oneDNN reports no bf16 support in this PyTorch"
    return True, f"this CPU computes bf16 natively ({have}, oneDNN's bf16 kernels)"


def device_choice(device: torch.device) -> tuple[str, str]:
    """The precision ``auto`` picks on ``device``, and why."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        gpu = f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"
        if (major, minor) >= (8, 0):
            return "bf16", f"{gpu} computes bf16 natively"
        return "fp16", f"{gpu} has no native bf16: fp16 with dynamic loss scaling"
    native, why = cpu_bf16()
    return ("bf16" if native else "fp32"), why


def settle(asked: str, device: torch.device, world: int) -> tuple[str, str | None]:
    """The precision a run trains in for the job's ``asked`` one, and, for ``auto``, why:
    every worker's own choice, and the gang's lowest when they differ (a collective: all
    workers call it)."""
    if asked != "auto":
        return asked, None
    chosen, why = device_choice(device)
    if world > 1 and dist.is_initialized():
        rank = torch.tensor([ORDER.index(chosen)], device=device)
        dist.all_reduce(rank, op=dist.ReduceOp.MIN)
        lowest = ORDER[int(rank.item())]
        if lowest != chosen:
            why += f"; another worker of the run chose {lowest}, which all of them run"
            chosen = lowest
    return chosen, f"auto: {why}"
