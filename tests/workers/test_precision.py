"""Precision ``auto`` (``workers/_precision.py``): what the workers detect, and what
bf16 changes where it is native.

- The detection follows what PyTorch's cpuinfo and oneDNN report, each case on its own
  (the reports stood in for), and on this machine it agrees with the GEMMs it speeds up:
  native bf16 runs a bf16 GEMM faster than fp32, emulated bf16 does not.
- Loss parity: the demo's LoRA job (SmolLM2-135M-Instruct, its data, its settings), trained
  in bf16 by the loop's own parts, follows the fp32 run's loss curve within a bound argued
  below. On CPUs without native bf16 it is skipped: emulated bf16 would take minutes, and
  ``auto`` never picks it there.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tunefleet.cli._demo import DATA, DEMO_JOB
from tunefleet.platform._defaults import base_learning_rate
from tunefleet.platform.models import BUILTIN_MODEL, ModelRegistry
from tunefleet.platform.spec import JobSpec
from tunefleet.workers import _precision
from tunefleet.workers.train._loop import make_optimizer, precision_context
from tunefleet.workers.train._loss import LabelledLogits, mean_loss
from tunefleet.workers.train._methods import build_model
from tunefleet.workers.train._metrics import measure_cpu_peak
from tunefleet.workers.train.data import collate, load_dataset

NATIVE, WHY = _precision.cpu_bf16()


def _reports(
    monkeypatch: pytest.MonkeyPatch, *, amx: bool, avx512_bf16: bool, onednn: bool = True
) -> None:
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: onednn)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)


def test_a_cpu_with_amx_or_avx512_bf16_computes_bf16_natively_and_says_which(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _reports(monkeypatch, amx=True, avx512_bf16=True)
    assert _precision.cpu_bf16() == (
        True,
        "this CPU computes bf16 natively (AMX and AVX512-BF16, oneDNN's bf16 kernels)",
    )
    _reports(monkeypatch, amx=False, avx512_bf16=True)
    assert _precision.device_choice(torch.device("cpu")) == (
        "bf16",
        "this CPU computes bf16 natively (AVX512-BF16, oneDNN's bf16 kernels)",
    )


def test_a_cpu_without_them_or_with_onednn_held_below_them_trains_in_fp32(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _reports(monkeypatch, amx=False, avx512_bf16=False)
    assert _precision.device_choice(torch.device("cpu")) == (
        "fp32",
        "this CPU has neither AMX nor AVX512-BF16 (PyTorch's cpuinfo)",
    )
    _reports(monkeypatch, amx=True, avx512_bf16=True)
    for cap in ("AVX2", "avx512_core", "AVX512_CORE_VNNI", "NOT_AN_ISA"):
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
        native, why = _precision.cpu_bf16()
        assert not native and f"ONEDNN_MAX_CPU_ISA={cap} keeps oneDNN's kernels below" in why
    for cap in ("AVX512_CORE_BF16", "avx512_core_amx", "ALL"):
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
        assert _precision.cpu_bf16()[0], cap
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", "AVX2")  # oneDNN's older name for the cap
    assert not _precision.cpu_bf16()[0]
    _reports(monkeypatch, amx=False, avx512_bf16=True, onednn=False)
    assert _precision.cpu_bf16() == (
        False,
        "this CPU has AVX512-BF16, but oneDNN reports no bf16 support in this PyTorch",
    )


def test_a_precision_the_job_names_is_kept_and_auto_is_settled_with_its_reason() -> None:
    cpu = torch.device("cpu")
    for asked in ("fp32", "bf16", "fp16"):
        assert _precision.settle(asked, cpu, world=1) == (asked, None)
    assert _precision.settle("auto", cpu, world=1) == (
        "bf16" if NATIVE else "fp32",
        f"auto: {WHY}",
    )


def test_serving_replicas_settle_auto_by_the_same_detection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``TUNEFLEET_SERVE_PRECISION``: a named precision is kept; ``auto`` is training's
    choice on this CPU, with its reason, and fp32 where oneDNN is held below bf16."""
    from tunefleet.workers.serve._adapters import serving_precision

    for asked in ("fp32", "bf16"):
        assert serving_precision(asked)[0] == asked
    assert serving_precision("auto") == ("bf16" if NATIVE else "fp32", f"auto: {WHY}")
    _reports(monkeypatch, amx=True, avx512_bf16=True)
    assert serving_precision("auto")[0] == "bf16"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert serving_precision("auto")[0] == "fp32"


def test_the_detection_agrees_with_the_gemms_of_this_machine() -> None:
    """Native bf16 runs a bf16 GEMM at least 1.5x as fast as fp32: AVX512-BF16's dot
    product does two bf16 multiply-adds per fp32 lane (2x), AMX far more, and the operands
    are half the bytes; 1.5 leaves a quarter for a busy machine (both are timed in CPU
    seconds). Emulated bf16 converts to fp32 and multiplies there, so it cannot beat fp32:
    at most 1.1x, the margin for noise. Measured on an AVX512-BF16 EPYC: 4.4x native, 0.8x
    with oneDNN capped at AVX512_CORE, 0.02x at AVX2."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core's figures: a neighbour on the other cannot skew them
    try:
        fp32 = measure_cpu_peak(torch.float32, 0.3)
        bf16 = measure_cpu_peak(torch.bfloat16, 0.3)
    finally:
        torch.set_num_threads(threads)
    ratio = bf16 / fp32
    assert ratio >= 1.5 if NATIVE else ratio <= 1.1, (NATIVE, WHY, ratio)


def _demo_losses(path: Path, precision: str, steps: int) -> list[float]:
    """The demo job's first ``steps`` training losses in ``precision``, trained by the loop's
    parts (its model build, optimizer, autocast and loss) on the demo's data in file
    order, 4 examples a step (the 56 lines give 14 steps)."""
    import json

    from transformers import AutoTokenizer

    config = json.loads((path / "config.json").read_text())
    spec = JobSpec.model_validate(
        {
            "job_id": "ftjob-precision",
            "tenant_id": "t",
            "model": BUILTIN_MODEL,
            "training_file": "file-1",
            "hyperparameters": {"n_epochs": 1, "batch_size": 4, "learning_rate_multiplier": 1},
            "base_learning_rate": base_learning_rate("lora", config)[0],
            "seed": DEMO_JOB["seed"],
            "tunefleet": {
                "max_seq_len": DEMO_JOB["tunefleet"]["max_seq_len"],
                "precision": precision,
            },
        }
    )
    tokenizer = AutoTokenizer.from_pretrained(path)
    examples = load_dataset(
        Path(str(DATA / "demo_train.jsonl")), tokenizer, spec.tunefleet.max_seq_len
    ).examples
    built = build_model(spec, str(path))
    model = built.model.train()
    labelled = LabelledLogits(model.get_output_embeddings())
    optimizer = make_optimizer(spec, [p for p in model.parameters() if p.requires_grad])
    losses = []
    for step in range(steps):
        batch = collate(examples[step * 4 : (step + 1) * 4], tokenizer.pad_token_id)
        with precision_context(spec, "cpu"):
            logits, targets = labelled(model, batch)
            loss = mean_loss(logits, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.slow
@pytest.mark.skipif(not NATIVE, reason=f"no native bf16 on this CPU: {WHY}")
def test_bf16_follows_the_fp32_loss_curve_of_the_demo_job(smollm_registry: Path) -> None:
    """The bound: each step's bf16 loss within 0.03 nats plus 3% of the fp32 run's.

    Both runs start from the same weights (the base stored in bf16 in one) and see the same
    batches. bf16 autocast rounds each GEMM's inputs to 8 significant bits (relative error
    2^-9) and accumulates in fp32, so a logit, a sum of 576 such products, is off by
    random-walk rounding of about 2^-9 x sqrt(576) ~ 5% of one term: a hundredth of a nat
    or so in a token's log-probability, and the mean loss moves by less (errors of
    different tokens cancel): the absolute 0.03. After the first step the runs follow
    slightly different gradients; AdamW normalises every parameter's step, so the weights
    drift apart by a small share of how far they move, and the loss gap grows with the
    loss's own size, not past it: the 3%. Measured on an AVX512-BF16 EPYC over 12 steps
    (loss 3.77 to 0.11): at most 0.017 nats, at a loss of 1.99 (the bound there: 0.09);
    the first step's gap 1e-4."""
    path = ModelRegistry(smollm_registry).require(BUILTIN_MODEL)
    fp32 = _demo_losses(path, "fp32", 12)
    bf16 = _demo_losses(path, "bf16", 12)
    print("fp32", [round(x, 4) for x in fp32], "\nbf16", [round(x, 4) for x in bf16])
    for a, b in zip(fp32, bf16, strict=True):
        assert abs(b - a) <= 0.03 + 0.03 * a, (fp32, bf16)
    assert max(fp32[-3:]) < fp32[0] / 3 and max(bf16[-3:]) < bf16[0] / 3, "both learn"
