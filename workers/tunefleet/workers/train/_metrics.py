"""Throughput figures for the per-step metrics: model FLOPs per token, the device's peak
FLOP/s (a table for GPUs, a GEMM measured at start-up on CPUs) and peak memory.

FLOPs per token follow PaLM's accounting (Chowdhery et al. 2022, appendix B): a forward
pass costs 2 FLOPs per parameter per token, a backward pass 4 when weights are trained (the
gradients of activations and of weights) and 2 when they are frozen (activations only;
LoRA and the other few-parameter methods), plus attention's 12 x layers x hidden x
sequence. The output layer counts only at labelled positions: the loop computes it only
there (``loss.py``). MFU is what the run achieves of that against the peak, for the whole
job; none on CPUs that emulate the job's 16-bit dtype.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from tunefleet.workers._precision import cpu_bf16
from tunefleet.workers.train import _probe as probe

# Dense bf16/fp16 tensor-core peak FLOP/s of common training GPUs (vendor data sheets,
# without sparsity), matched against torch.cuda.get_device_name().
GPU_PEAK_FLOPS = {
    "H200": 989e12,
    "H100 PCIe": 756e12,  # before "H100": the first name found in the device's wins
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10G": 70e12,
    "A10": 125e12,
    "V100": 125e12,
    "T4": 65e12,
}


def _flops_per_param(total_params: int, trainable_params: int) -> int:
    """Training FLOPs per parameter per token: forward 2, gradient of the input 2, and
    gradient of the weight 2 where the weights are trained (full fine-tuning, or close)."""
    return 6 if trainable_params >= 0.5 * total_params else 4


def flops_per_token(total_params: int, trainable_params: int, config: Any, seq: float) -> float:
    """Training FLOPs per token for a model of ``total_params`` of which
    ``trainable_params`` are trained, at mean sequence length ``seq``."""
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    per_param = _flops_per_param(total_params, trainable_params)
    return per_param * total_params + 12 * layers * hidden * seq


def mfu(
    *,
    tokens: int,
    labels: int,
    flops_per_token: float,
    output_layer_flops: float,
    seconds: float,
    peak_flops: float,
) -> float | None:
    """Model FLOPs utilisation of ``tokens`` trained in ``seconds`` (``labels`` of them
    labelled: the output layer runs only there) against ``peak_flops`` (every worker's
    device at its peak); None without a peak (a CPU emulating the dtype)."""
    if not peak_flops:
        return None
    done = tokens * (flops_per_token - output_layer_flops) + labels * output_layer_flops
    return done / seconds / peak_flops


def output_layer_flops(total_params: int, trainable_params: int, config: Any) -> float:
    """The part of ``flops_per_token`` that is the output layer's. The loop runs it only at
    labelled positions (``loss.py``) and counts it only there."""
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    return _flops_per_param(total_params, trainable_params) * vocab * hidden


def native_cpu_dtype(dtype: torch.dtype) -> bool:
    """Whether this CPU computes ``dtype`` natively (fp32 always; bf16 as ``cpu_bf16``
    says; fp16 with AMX-FP16); without, torch emulates it at a few GFLOP/s."""
    if dtype == torch.bfloat16:
        return cpu_bf16()[0]
    if dtype == torch.float16:
        return bool(torch.cpu._is_amx_fp16_supported())
    return True


def measure_cpu_peak(dtype: torch.dtype, seconds: float = 0.15) -> float:
    """FLOP/s of the best of two square GEMMs in ``dtype`` on this process's threads: the
    CPU's practical peak for this run. Timed in CPU seconds per thread, not wall seconds:
    another process on the same cores (Ray starting workers, a test suite, a neighbour's
    job) slows the wall clock but not the work done per CPU-second, so a busy machine at
    start-up does not understate the peak (and MFU cannot read above 1 for it).
    Meaningful for dtypes the CPU computes natively (``native_cpu_dtype``); the loop
    measures no other, the training bench reports both."""
    best = 0.0
    threads = torch.get_num_threads()
    # its own generator: the training's random stream (dropout, and what a resumed run
    # restores from its checkpoint) must not move
    gen = torch.Generator().manual_seed(0)
    for n in (512, 1024):
        a = torch.randn(n, n, generator=gen).to(dtype)
        b = torch.randn(n, n, generator=gen).to(dtype)
        a @ b  # warm-up
        count, started, cpu_started = 0, time.perf_counter(), time.process_time()
        while time.perf_counter() - started < seconds or count < 2:
            a @ b
            count += 1
        cpu_per_thread = (time.process_time() - cpu_started) / threads
        best = max(best, 2 * n**3 * count / max(cpu_per_thread, 1e-9))
    return best


def device_peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """The peak FLOP/s of one worker's device and where the figure comes from."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in GPU_PEAK_FLOPS.items():
            if key in name:
                return peak, f"{name} data sheet"
        return 0.0, f"{name} not in the peak table"
    if not native_cpu_dtype(dtype):
        # an emulated GEMM's speed depends on shapes and values: no peak worth the name
        return 0.0, f"{dtype} is emulated on this CPU: no MFU (train in fp32 here)"
    return measure_cpu_peak(dtype), f"{dtype} GEMM measured at start-up"


def peak_memory_bytes(device: torch.device) -> int:
    """GPU: the most torch allocated since the last reset; CPU: the process's peak
    resident set so far (VmHWM)."""
    if device.type == "cuda":
        peak = int(torch.cuda.max_memory_allocated(device))
        torch.cuda.reset_peak_memory_stats(device)
        return peak
    return probe.status_kib("VmHWM") * 1024
