"""Training throughput: TuneFleet's training loop against a transformers ``Trainer`` + peft,
in each precision the CPU computes natively.

The same LoRA fine-tune of SmolLM2-135M (r=16 on every projection), the same chat data of
varied lengths (made here, seeded), the same number of optimizer steps, micro-batch,
accumulation and maximum length, run three ways in one process tree, in fp32 and, where
the CPU computes bf16 natively (what precision ``auto`` then settles), again in bf16:

- **trainer**: the seeds' ``TrainingArguments`` recipe (micro-batch 4, gradient
  accumulation, gradient checkpointing on, AdamW) with batches padded to their longest
  example (``DataCollatorForSeq2Seq``); bf16 is its own ``bf16=True`` (autocast). The
  recipe's ``paged_adamw_8bit`` needs a GPU: on a CPU it uses torch's AdamW.
- **trainer without checkpointing**: the same Trainer with ``gradient_checkpointing`` off,
  the same settings as TuneFleet's (its planner turns checkpointing off here), to show
  which part of the gain is the planner's choice and which is the loop's.
- **TuneFleet**: a job through the real driver on a local Ray cluster (one worker, the
  same CPUs), with the options a user sets for throughput: sequence packing, the planner's
  ``gradient_checkpointing: auto``, fused AdamW; ``precision: fp32``, and the default
  ``auto`` (bf16 here: a frozen base stored in bf16, autocast). Its figures are the
  loop's own per-step metrics.

Each run's precision is read from the run itself (the Trainer's: autocast's state inside
its forward passes; TuneFleet's: its first event), and a run in another precision than
its side's stops the bench. "Same micro-batch" counts units: 4 examples for the Trainer,
4 packed rows of up to ``max_seq_len`` tokens for TuneFleet, so TuneFleet's steps carry
about twice the tokens; the ratio is of tokens/s and includes what packing brings.
TuneFleet's clock times each step's training (not its metrics write); the Trainer's runs
from step end to step end. Tokens are real (not padding) tokens; the first step of each
run is a warm-up and is not timed. MFU is model FLOPs (``metrics.flops_per_token``, PaLM's
count) per second against the GEMM peak measured here in the run's precision.

    .venv/bin/python bench/train_throughput.py    # ~10 min; bench/results/train_throughput.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import machine

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "train_throughput.json"
TARGET_RATIO = 1.5
TARGET_MFU = 0.35
TARGET_BF16_SPEEDUP = 2.0  # TuneFleet in bf16 against itself in fp32, on native-bf16 CPUs
THREADS = 2  # the Ray worker's cpus_per_worker, and torch's threads in the baseline
LORA = {"r": 16, "alpha": 32, "dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj",
                           "gate_proj", "up_proj", "down_proj"]}  # fmt: skip
_TEXT = (
    "the ship sails north across a calm grey sea while the crew mends nets and counts "
    "barrels of salt fish rope lantern harbour storm captain island chart compass tide "
    "river market bread cheese apple orchard winter summer mountain valley village road "
    "bridge tower garden letter story song music river forest stone silver copper iron "
    "engine signal station morning evening quiet loud bright dark warm cold quickly slowly "
    "because although before after during between under over through into onto about"
)
WORDS = _TEXT.split()


def make_data(path: Path, n: int, max_words: int, seed: int) -> None:
    """``n`` chat examples whose lengths spread from a few words to ``max_words``."""
    rnd = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            ask, answer = rnd.randint(4, max_words // 2), rnd.randint(4, max_words // 2)
            say = lambda k: " ".join(rnd.choice(WORDS) for _ in range(k))  # noqa: E731
            messages = [
                {"role": "user", "content": f"Continue these notes: {say(ask)}"},
                {"role": "assistant", "content": say(answer)},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")


def token_clock(model: Any, *, grad_only: bool = False) -> tuple[dict[str, int], list[Any], Any]:
    """Counts of the real and the padded tokens ``model``'s forward passes see (with
    ``grad_only``, only those that compute gradients: not a reference model's), the
    (time, real tokens) marks at each step's end, and the Trainer callback that makes them."""
    import torch
    from transformers import TrainerCallback

    seen: dict[str, Any] = {"tokens": 0, "padded": 0, "precision": set()}

    def count(_module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
        if torch.is_grad_enabled() or not grad_only:
            seen["tokens"] += int(kwargs["attention_mask"].sum())
            seen["padded"] += kwargs["attention_mask"].numel()

    def precision(_module: Any, _args: Any) -> None:
        # what the layers compute in, read inside the run (a hook on the model itself runs
        # before the autocast the Trainer wraps its forward in): autocast's dtype, or fp32
        autocast = torch.is_autocast_enabled("cpu")
        dtypes = {torch.bfloat16: "bf16", torch.float16: "fp16"}
        seen["precision"].add(dtypes[torch.get_autocast_dtype("cpu")] if autocast else "fp32")

    model.register_forward_pre_hook(count, with_kwargs=True)
    layer = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    layer.register_forward_pre_hook(precision)
    marks: list[tuple[float, int]] = []

    class Clock(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, *_: Any, **__: Any) -> None:
            marks.append((time.perf_counter(), seen["tokens"]))

    return seen, marks, Clock()


def run_trainer(
    model_path: Path, data: Path, args: argparse.Namespace, checkpointing: bool, bf16: bool
) -> dict[str, Any]:
    """The baseline; tokens/s over the steps after the first. ``bf16``: the Trainer's own
    ``bf16=True`` (autocast; the model's weights stay fp32, as its recipe loads them)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        DataCollatorForSeq2Seq,
        Trainer,
        TrainingArguments,
    )

    from tunefleet.workers.train.data import load_dataset

    torch.set_num_threads(THREADS)
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    # The same tokens as TuneFleet's: chat template, loss on the assistant's tokens only.
    examples = load_dataset(data, tokenizer, args.max_seq_len).examples
    rows = [{"input_ids": e.input_ids, "labels": e.labels} for e in examples]
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model = get_peft_model(
        model,
        LoraConfig(
            r=LORA["r"],
            lora_alpha=LORA["alpha"],
            lora_dropout=LORA["dropout"],
            target_modules=LORA["target_modules"],
            task_type="CAUSAL_LM",
        ),
    )
    seen, marks, clock = token_clock(model)

    with tempfile.TemporaryDirectory() as out:
        training_args = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=args.micro_batch,
            gradient_accumulation_steps=args.accum,
            activation_checkpointing=checkpointing,  # transformers 5's gradient_checkpointing
            optim="adamw_torch",
            learning_rate=2e-4,
            max_steps=args.steps,
            logging_steps=args.steps,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            bf16=bf16,
            seed=args.seed,
            dataloader_num_workers=0,
            remove_unused_columns=False,
        )
        trainer = Trainer(
            model=model,
            args=training_args,
            train_dataset=rows,
            data_collator=DataCollatorForSeq2Seq(tokenizer, padding=True),
            callbacks=[clock],
        )
        trainer.train()
    (t0, n0), (t1, n1) = marks[0], marks[-1]
    (precision,) = seen["precision"]
    return {
        "precision": precision,
        "tokens_per_s": (n1 - n0) / (t1 - t0),
        "timed_steps": len(marks) - 1,
        "timed_tokens": n1 - n0,
        "real_share_of_computed_tokens": seen["tokens"] / seen["padded"],
        "gradient_checkpointing": checkpointing,
    }


def run_tunefleet(
    model_path: Path,
    data: Path,
    args: argparse.Namespace,
    options: dict[str, Any] | None = None,
    gpus: int = 0,
    *,
    method: dict[str, Any] | None = None,
    file_format: str = "chat",
) -> dict[str, Any]:
    """A job through the real driver on a local Ray cluster (one worker: ``THREADS`` CPUs,
    or one GPU); ``options`` change the job's ``tunefleet`` options, ``method`` is its
    OpenAI ``method`` object (default supervised) for a file of ``file_format``. Figures
    from the loop's own metrics events."""
    import ray
    from sqlalchemy import select

    from tunefleet.platform.artifacts import ArtifactStore
    from tunefleet.platform.db import File, JobEvent, session_scope
    from tunefleet.platform.db.migrate import upgrade
    from tunefleet.platform.jobs import JobCreateRequest, create_job
    from tunefleet.platform.models import BUILTIN_MODEL, ModelRegistry
    from tunefleet.platform.planner import PlanDevice
    from tunefleet.platform.settings import get_settings
    from tunefleet.platform.tenants import authenticate, create_key, create_tenant
    from tunefleet.workers.backend import RayBackend
    from tunefleet.workers.controller import Controller

    work = Path(tempfile.mkdtemp(prefix="tf-bench-"))
    url = f"sqlite:///{work / 'db.sqlite'}"
    os.environ.update(
        TUNEFLEET_DATA_DIR=str(work),
        TUNEFLEET_DATABASE_URL=url,
        TUNEFLEET_MODEL_REGISTRY=str(model_path.parent),
    )
    get_settings.cache_clear()
    upgrade(url)
    store = ArtifactStore(work / "artifacts")
    store.write_bytes(store.file_key("file-bench"), data.read_bytes())
    with session_scope(url) as s:
        tenant = create_tenant(s, "bench")
        principal = authenticate(s, f"Bearer {create_key(s, tenant.id)[1]}")
        s.add(File(id="file-bench", tenant_id=tenant.id, filename=data.name,
                   purpose="fine-tune", bytes=data.stat().st_size, status="processed",
                   format=file_format, stats={}, path=store.file_key("file-bench")))  # fmt: skip
        s.flush()
        request = JobCreateRequest.model_validate(
            {
                "model": BUILTIN_MODEL,
                "training_file": "file-bench",
                "seed": args.seed,
                "hyperparameters": {"n_epochs": 1, "batch_size": args.micro_batch * args.accum},
                **({"method": method} if method else {}),
                "tunefleet": {
                    "lora": LORA,
                    "max_seq_len": args.max_seq_len,
                    "max_steps": args.steps,
                    "micro_batch_size": args.micro_batch,
                    "packing": True,
                    "gradient_checkpointing": "auto",
                    "resources": {
                        "num_workers": 1,
                        "cpus_per_worker": THREADS,
                        "gpus_per_worker": gpus,
                    },
                    **(options or {}),
                },
            }
        )
        # planned for the device the API plans for (settings), as a job made through it is
        device = PlanDevice.from_gb(get_settings().device_memory_gb, get_settings().host_memory_gb)
        registry = ModelRegistry(model_path.parent)
        job_id = create_job(s, principal, request, registry, device=device).id
    ray.init(num_cpus=THREADS, num_gpus=gpus, include_dashboard=False, log_to_driver=False)
    try:
        settings = get_settings()
        Controller(settings, RayBackend(settings)).run_in_process(job_id, f"{job_id}-1")
    finally:
        ray.shutdown()
    with session_scope(url) as s:
        events = list(
            s.scalars(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.seq))
        )
    steps = [e.data for e in events if e.type == "metrics"]
    start = next(e for e in events if e.data and "flops_per_token" in e.data)
    if len(steps) != args.steps:
        raise RuntimeError(f"the job reported {len(steps)} of {args.steps} steps: {events}")
    timed = steps[1:]
    # a step's time is its tokens over its tokens/s (the loop's own window of the step)
    tokens = sum(m["step_tokens"] for m in timed)
    seconds = sum(m["step_tokens"] / m["tokens_per_s"] for m in timed)
    return {
        "precision": start.data["precision"],  # what the run trained in (auto: its choice)
        "tokens_per_s": tokens / seconds,
        "timed_steps": len(timed),
        "timed_tokens": tokens,
        # what the planner settled for "auto" (the loop's first event says)
        "gradient_checkpointing": "gradient checkpointing" in start.message,
        "packing": (options or {}).get("packing", True),
        "flops_per_token": start.data["flops_per_token"],
        # the loop's own: the output layer counted at labelled positions only
        "reported_mfu": [m["mfu"] for m in timed],
        "reported_peak_flops": start.data["peak_flops"],
        "peak_memory_bytes": max(m["peak_memory_bytes"] for m in steps),
        "first_loss": steps[0]["train_loss"],
        "last_loss": steps[-1]["train_loss"],
        "first_event": start.message,
    }


def workload_parser(
    description: str, *, steps: int, micro_batch: int, accum: int, max_seq_len: int
) -> argparse.ArgumentParser:
    """The options of a training workload (``run_tunefleet``'s ``args``), with defaults."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--micro-batch", type=int, default=micro_batch)
    parser.add_argument("--accum", type=int, default=accum)
    parser.add_argument("--max-seq-len", type=int, default=max_seq_len)
    parser.add_argument("--examples", type=int, default=400)
    parser.add_argument("--seed", type=int, default=7)
    return parser


def main() -> None:
    parser = workload_parser(
        __doc__.splitlines()[0], steps=6, micro_batch=4, accum=2, max_seq_len=256
    )
    args = parser.parse_args()

    sys.path.insert(0, str(ROOT / "workers"))
    import torch

    from tunefleet.platform.models import ModelRegistry
    from tunefleet.platform.settings import get_settings
    from tunefleet.workers.model_registry import prepare_builtin
    from tunefleet.workers.train._metrics import measure_cpu_peak

    model_path = prepare_builtin(ModelRegistry(get_settings().resolved_model_registry))
    data = Path(tempfile.mkdtemp(prefix="tf-bench-data-")) / "varied.jsonl"
    make_data(data, args.examples, max_words=int(args.max_seq_len * 0.6), seed=args.seed)

    torch.set_num_threads(THREADS)
    native = machine.native_bf16()[0]
    peaks = {"fp32": measure_cpu_peak(torch.float32, 1.0),
             "bf16": measure_cpu_peak(torch.bfloat16, 1.0)}  # fmt: skip
    # fp32 on every CPU; bf16 (what precision "auto" settles) where the CPU computes it
    # natively: elsewhere auto is fp32 and bf16 an emulation no one would train in
    sides: dict[str, dict[str, Any]] = {}
    for precision in ("fp32", "bf16") if native else ("fp32",):
        bf16 = precision == "bf16"
        side = sides[precision] = {
            "trainer": run_trainer(model_path, data, args, checkpointing=True, bf16=bf16),
            "trainer_without_checkpointing": run_trainer(
                model_path, data, args, checkpointing=False, bf16=bf16
            ),
            # fp32 named; bf16 as the default "auto" chose it, which the run reports
            "tunefleet": run_tunefleet(
                model_path, data, args, None if bf16 else {"precision": "fp32"}
            ),
        }
        per_token = side["tunefleet"]["flops_per_token"]
        for run in side.values():
            if run["precision"] != precision:
                raise RuntimeError(f"a {precision} run trained in {run['precision']}: {run}")
            # against the measured GEMM peak of the precision the run computed in
            run["mfu"] = run["tokens_per_s"] * per_token / peaks[precision]
        ours = side["tunefleet"]["tokens_per_s"]
        side["ratio_vs_trainer"] = ours / side["trainer"]["tokens_per_s"]
        side["ratio_vs_trainer_without_checkpointing"] = (
            ours / side["trainer_without_checkpointing"]["tokens_per_s"]
        )
    auto = sides["bf16" if native else "fp32"]
    target: dict[str, Any] = {
        "ratio": TARGET_RATIO,
        "mfu": TARGET_MFU,
        # auto against the Trainer in the same precision, with the seeds' checkpointing
        # and without it (the same settings as TuneFleet's, whose planner turned it off)
        "ratio_met": auto["ratio_vs_trainer"] >= TARGET_RATIO,
        "ratio_without_checkpointing_met": (
            auto["ratio_vs_trainer_without_checkpointing"] >= TARGET_RATIO
        ),
        "mfu_met": auto["tunefleet"]["mfu"] >= TARGET_MFU,
    }
    if native:
        speedup = (
            sides["bf16"]["tunefleet"]["tokens_per_s"] / sides["fp32"]["tunefleet"]["tokens_per_s"]
        )
        target.update(bf16_vs_fp32=TARGET_BF16_SPEEDUP, bf16_vs_fp32_measured=speedup,
                      bf16_vs_fp32_met=speedup >= TARGET_BF16_SPEEDUP)  # fmt: skip
    result = {
        "model": "SmolLM2-135M-Instruct",
        "lora": LORA,
        "steps": args.steps,
        "micro_batch": args.micro_batch,
        "accumulation": args.accum,
        "max_seq_len": args.max_seq_len,
        "threads": THREADS,
        "machine": machine.describe(),
        "native_bf16": native,
        "auto_precision": auto["tunefleet"]["precision"],
        "gemm_peak_flops": peaks,
        "runs": sides,
        "target": target,
    }
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
