"""Planner accuracy: predicted vs measured memory of one real training step, per method.

Each case runs in a fresh process (`measure` below, in a child forked from one that has
imported the libraries once): it builds a random Llama as the
training loop does, wraps it for the method (peft LoRA, or all parameters for full
fine-tuning), takes one AdamW step on a batch of random tokens, and measures
- *states*: bytes of parameters, gradients and optimizer-state tensors, counted exactly;
- *peak*: the process's peak resident memory during the step (Linux VmHWM, reset just
  before the step) minus its resident memory before the model was built, with glibc told
  to mmap every large block so freed tensors leave the resident set at once. Neither
  counts the pages of the libraries' files (torch's code and data, about 150 MiB that the
  first steps map in, more or fewer with what the page cache holds, since fault-around
  maps only cached pages); the weights' file, which the loader maps, is counted. A step
  on a tiny model of the same case comes first, so that what the first build imports and
  sets up is in neither.
The planner's prediction for the same case comes from `tunefleet.platform.planner`.

    .venv/bin/python bench/planner_accuracy.py        # writes bench/results/planner_accuracy.json

On a GPU, ``--cuda`` (run by bench/gpu_check.py) measures the same cases with the CUDA
allocator instead: *peak* is ``torch.cuda.max_memory_allocated`` over the step (reset
just before it) less what was allocated before the model was built, and it prints the
rows. The allocator's own count leaves out the CUDA context and cuBLAS's workspace.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import machine

ROOT = Path(__file__).resolve().parents[1]

# A Llama large enough that tensors dwarf allocator and library noise on the CPU.
SHAPE = {"vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1376,
         "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4,
         "tie_word_embeddings": False}  # fmt: skip

CASES: list[dict[str, Any]] = [
    {"method": "lora", "targets": ["q_proj", "v_proj"], "batch": 4, "seq": 256, "ckpt": False},
    {"method": "lora", "targets": ["all-linear"], "batch": 4, "seq": 256, "ckpt": False},
    {"method": "lora", "targets": ["all-linear"], "batch": 4, "seq": 256, "ckpt": True},
    {"method": "full", "targets": [], "batch": 4, "seq": 256, "ckpt": False},
    {"method": "full", "targets": [], "batch": 2, "seq": 256, "ckpt": False},
    {
        "method": "lora",
        "targets": ["all-linear"],
        "batch": 4,
        "seq": 256,
        "ckpt": False,
        "precision": "bf16",
    },
    {"method": "full", "targets": [], "batch": 2, "seq": 256, "ckpt": False, "precision": "bf16"},
    {"method": "qlora", "targets": ["all-linear"], "batch": 4, "seq": 256, "ckpt": False},
    {"method": "ia3", "targets": [], "batch": 4, "seq": 256, "ckpt": False},
    {"method": "prefix_tuning", "targets": [], "batch": 4, "seq": 256, "ckpt": False},
    {"method": "prompt_tuning", "targets": [], "batch": 4, "seq": 256, "ckpt": False},
    {"method": "bitfit", "targets": [], "batch": 4, "seq": 256, "ckpt": False, "bias": True},
    {"method": "adapter", "targets": [], "batch": 4, "seq": 256, "ckpt": False},
]


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _library_kib(keep: str) -> int:
    """Resident KiB of the files this process maps, other than those under ``keep``."""
    total, counted = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=5)
        if len(head) >= 5 and "-" in head[0] and ":" in head[3]:  # a mapping's first line
            path = head[5] if len(head) == 6 else ""
            counted = path.startswith("/") and not path.startswith(keep)
        elif counted and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


def shape_of(case: dict[str, Any]) -> dict[str, Any]:
    """The model config of a case: SHAPE, with biases on every projection for BitFit."""
    return {**SHAPE, "attention_bias": True, "mlp_bias": True} if case.get("bias") else SHAPE


def case_spec(case: dict[str, Any]) -> Any:
    """The job spec of a case, as the API would store it."""
    from tunefleet.platform.spec import JobSpec

    return JobSpec.model_validate(
        {
            "job_id": "ftjob-accuracy",
            "tenant_id": "t",
            "model": "accuracy-llama",
            "training_file": "file-x",
            "hyperparameters": {
                "n_epochs": 1,
                "batch_size": case["batch"],
                "learning_rate_multiplier": 1,
            },
            "seed": 0,
            "tunefleet": {
                "method": case["method"],
                "lora": {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": case["targets"]}
                if case["targets"]
                else {},
                "precision": case.get("precision", "fp32"),
                "gradient_checkpointing": case["ckpt"],
                "max_seq_len": case["seq"],
                "micro_batch_size": case["batch"],
            },
        }
    )


def measure(case: dict[str, Any]) -> dict[str, Any]:
    """Run in a fresh process (see ``measure_each``): one real step of the training loop's own
    model, optimizer and precision context (``tunefleet.workers.train``), measured."""
    import gc
    import tempfile

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tunefleet.workers.train._loop import make_optimizer, precision_context
    from tunefleet.workers.train._methods import build_model

    spec = case_spec(case)
    autocast = precision_context(spec, "cpu")

    def save(tmp: str, **smaller: int) -> None:
        torch.manual_seed(0)
        config = LlamaConfig(**{**shape_of(case), **smaller}, attn_implementation="sdpa")
        LlamaForCausalLM(config).save_pretrained(tmp)

    # A tiny model of the same case first, one step: what the first build and step import
    # and set up (peft, the loaders, kernels; about 55 MiB) is not the step's memory.
    with tempfile.TemporaryDirectory() as tmp:
        save(tmp, vocab_size=256, hidden_size=64, intermediate_size=128)
        tiny = build_model(spec, tmp).model
        tiny.train()
        ids = torch.randint(0, 256, (1, 16))
        with autocast:
            loss = tiny(input_ids=ids, labels=ids).loss
        loss.float().backward()
        make_optimizer(spec, [p for p in tiny.parameters() if p.requires_grad]).step()
        del tiny, loss
    with tempfile.TemporaryDirectory() as tmp:
        save(tmp)
        gc.collect()
        base = _rss_kib("VmRSS") - _library_kib(tmp)
        model = build_model(spec, tmp).model
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(spec, params)
    ids = torch.randint(0, SHAPE["vocab_size"], (case["batch"], case["seq"]))

    def step() -> int:
        with autocast:
            loss = model(input_ids=ids, labels=ids).loss
        loss.float().backward()
        peak = _rss_kib("VmHWM")
        optimizer.step()
        return max(peak, _rss_kib("VmHWM"))

    # warm-up step: lazily created optimizer states and library buffers exist afterwards
    step()
    optimizer.zero_grad(set_to_none=True)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS mark
    peak = step() - _library_kib(tmp)

    trainable = sum(p.numel() for p in params)
    # a 4-bit tensor packs two values per stored byte
    total = sum(
        p.numel() * (2 if type(p).__name__ == "Params4bit" else 1) for p in model.parameters()
    )
    return {
        "states_bytes": _state_bytes(model, params, optimizer),
        "peak_bytes": (peak - base) * 1024,
        "trainable": trainable,
        "total": total,
    }


def _state_bytes(model: Any, params: list[Any], optimizer: Any) -> int:
    """Bytes of the parameters (4-bit ones with their quantization constants), gradients
    and optimizer states, counted exactly."""

    def nbytes(t: Any) -> int:
        return int(t.numel() * t.element_size())

    n_bytes = sum(nbytes(p) for p in model.parameters())
    # 4-bit weights keep their quantization constants beside the packed data
    n_bytes += sum(
        nbytes(t)
        for p in model.parameters()
        if (qs := getattr(p, "quant_state", None)) is not None
        for t in (qs.absmax, qs.code, *((qs.state2.absmax, qs.state2.code) if qs.nested else ()))
    )
    g_bytes = sum(nbytes(p.grad) for p in params if p.grad is not None)
    o_bytes = sum(
        nbytes(t)
        for st in optimizer.state.values()
        for t in st.values()
        if hasattr(t, "element_size")
    )
    return n_bytes + g_bytes + o_bytes


def measure_cuda(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each case's step on the GPU, one after another in this process (the allocator's peak
    is reset for each), against the planner's prediction."""
    import gc

    import torch

    rows = []
    for case in cases:
        gc.collect()
        torch.cuda.empty_cache()
        rows.append(row(case, _measure_cuda(case)))
    return rows


def _measure_cuda(case: dict[str, Any]) -> dict[str, Any]:
    """One real step of ``case`` on the GPU: states counted as ``measure`` counts them,
    the peak from the CUDA allocator less what it held before the model was built."""
    import tempfile

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tunefleet.workers.train._loop import make_optimizer, precision_context
    from tunefleet.workers.train._methods import build_model

    spec = case_spec(case)
    base = torch.cuda.memory_allocated()
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        config = LlamaConfig(**shape_of(case), attn_implementation="sdpa")
        LlamaForCausalLM(config).save_pretrained(tmp)
        model = build_model(spec, tmp).model.to("cuda")
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(spec, params)
    ids = torch.randint(0, SHAPE["vocab_size"], (case["batch"], case["seq"]), device="cuda")

    def step() -> None:
        with precision_context(spec, "cuda"):
            loss = model(input_ids=ids, labels=ids).loss
        loss.float().backward()
        optimizer.step()

    step()  # warm-up: the optimizer's states exist afterwards
    optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return {"states_bytes": _state_bytes(model, params, optimizer), "peak_bytes": peak}


def measure_each(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``measure`` for each case, each in a child forked from this process once it has
    imported the loop's libraries: a fresh heap per case without paying the imports again."""
    import tunefleet.workers.train._loop
    import tunefleet.workers.train._methods  # noqa: F401

    rows = []
    for case in cases:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: measure, answer, and leave without running any cleanup
            os.close(read)
            try:
                os.write(write, json.dumps(measure(case)).encode())
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read) as answer:
            text = answer.read()
        _, status = os.waitpid(pid, 0)
        if not text or os.waitstatus_to_exitcode(status) != 0:
            raise RuntimeError(f"measuring {case} failed (exit status {status})")
        rows.append(json.loads(text))
    return rows


# What the measuring process takes of its caller's environment: nothing else, so that the
# same case measures the same alone and after a whole test session (whose fixtures leave
# Ray, S3 and other settings in the environment).
KEPT_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "PYTHONPATH")


def run_cases(cases: list[dict[str, Any]], threads: int = 2) -> list[dict[str, Any]]:
    """``measure_each`` in a fresh process of ``threads`` compute threads."""
    env = {k: os.environ[k] for k in KEPT_ENV if k in os.environ}
    env.update(MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS=str(threads))
    out = subprocess.run(
        [sys.executable, __file__, "--measure", json.dumps(cases)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return list(json.loads(out.stdout.strip().splitlines()[-1]))


def predict(case: dict[str, Any]) -> dict[str, Any]:
    from tunefleet.platform.planner import (
        ModelShape,
        parameter_counts,
        plan_input_from_spec,
        plan_memory,
    )

    shape = ModelShape.from_config(shape_of(case))
    inp = plan_input_from_spec(case_spec(case), shape)  # as the API plans a job
    plan = plan_memory(shape, inp)
    trainable, total = parameter_counts(shape, inp)
    return {
        "states_bytes": plan.states,
        "peak_bytes": plan.total,
        "trainable": trainable,
        "total": total,
    }


def row(case: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    """A case's measurement beside the planner's prediction, and their relative errors."""
    predicted = predict(case)
    return {
        "case": case,
        "measured": measured,
        "predicted": predicted,
        "states_error": predicted["states_bytes"] / measured["states_bytes"] - 1,
        "peak_error": predicted["peak_bytes"] / measured["peak_bytes"] - 1,
    }


def compare(cases: list[dict[str, Any]], threads: int = 2) -> list[dict[str, Any]]:
    """Measured against predicted for each case, measured in one fresh process of
    ``threads`` compute threads (memory does not depend on them; the test runs two such
    processes at once)."""
    rows = []
    for case, measured in zip(cases, run_cases(cases, threads), strict=True):
        rows.append(row(case, measured))
    return rows


def main() -> None:
    rows = compare(CASES)
    out = {
        "benchmark": "planner_accuracy",
        "device": "cpu",
        "machine": machine.describe(),
        "shape": SHAPE,
        "note": "cases with bias: true add attention_bias and mlp_bias to the shape",
        "rows": rows,
        "max_abs_states_error": max(abs(r["states_error"]) for r in rows),
        "max_abs_peak_error": max(abs(r["peak_error"]) for r in rows),
        "targets": {"states": 0.05, "peak": 0.25},
    }
    dest = ROOT / "bench" / "results" / "planner_accuracy.json"
    dest.write_text(json.dumps(out, indent=2) + "\n")
    for r in rows:
        c = r["case"]
        print(
            f"{c['method']:13} {','.join(c['targets']) or '-':14} b={c['batch']} s={c['seq']} "
            f"ckpt={c['ckpt']!s:5} {c.get('precision', 'fp32')}  "
            f"states {r['states_error']:+.1%}  peak {r['peak_error']:+.1%}"
            f"  (measured peak {r['measured']['peak_bytes'] / 2**20:.0f} MiB)"
        )


if __name__ == "__main__":
    if sys.argv[1:] == ["--cuda"]:
        print(json.dumps(measure_cuda(CASES)))
    elif len(sys.argv) == 3 and sys.argv[1] == "--measure":
        print(json.dumps(measure_each(json.loads(sys.argv[2]))))
    else:
        main()
