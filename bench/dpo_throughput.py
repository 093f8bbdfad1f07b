"""DPO throughput: TuneFleet's preference tuning against TRL's ``DPOTrainer`` + peft.

The same LoRA DPO of SmolLM2-135M-Instruct (r=16 on every projection, beta 0.1), the same
preference pairs (made here, seeded: a prompt, then a chosen and a rejected answer of
varied lengths), the same number of optimizer steps, micro-batch of pairs, accumulation
and maximum length, fp32 with AdamW on ``THREADS`` CPU threads, in one run:

- **TRL**: ``DPOTrainer`` (PyPI ``trl``, ``make bench-deps``) with a peft ``LoraConfig``
  and no ``ref_model``, so its reference is the base with the adapter switched off, as
  TuneFleet's; ``DPOConfig`` defaults otherwise (chosen and rejected concatenated into
  one forward, padded to the longest, no precomputed reference, dropout off). It runs in
  a child process of its own, so that its peak resident memory is its own.
- **TuneFleet**: a DPO job through the real driver on a local Ray cluster, one worker of
  ``THREADS`` CPUs (``train_throughput.run_tunefleet``). Its figures are the loop's own
  per-step metrics; its peak memory is the worker process's peak resident set.

Both run with gradient checkpointing on (TRL's default) and both with it off (what
TuneFleet's planner picks when the memory is there), side by side in each round.

Tokens are the real (not padding) tokens of both sequences of every pair the policy's
forward passes see (the prompt counts twice: both sequences carry it); the reference's
forward passes are work on top, in both. The first step of each run is a warm-up and is
not timed. Peak memory on a CPU is the training process's peak resident set: the model,
activations and optimizer states, and each program's imports.

    make bench-deps && .venv/bin/python bench/dpo_throughput.py   # ~6 min
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import machine
from train_throughput import LORA, THREADS, WORDS, run_tunefleet, token_clock, workload_parser

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "dpo_throughput.json"
TARGET_RATIO = 1.3
BETA = 0.1
LEARNING_RATE = 1e-4


def make_pairs(path: Path, n: int, max_words: int, seed: int) -> None:
    """``n`` preference pairs in OpenAI's format, prompts and answers of varied lengths."""
    rnd = random.Random(seed)

    def say(k: int) -> str:
        return " ".join(rnd.choice(WORDS) for _ in range(k))

    with path.open("w") as f:
        for _ in range(n):
            ask = rnd.randint(4, max_words // 3)
            chosen, rejected = rnd.randint(4, max_words // 3), rnd.randint(4, max_words // 3)
            pair = {
                "input": {"messages": [{"role": "user", "content": f"Continue: {say(ask)}"}]},
                "preferred_output": [{"role": "assistant", "content": say(chosen)}],
                "non_preferred_output": [{"role": "assistant", "content": say(rejected)}],
            }
            f.write(json.dumps(pair) + "\n")


def run_trl(
    model_path: Path, data: Path, args: argparse.Namespace, checkpointing: bool
) -> dict[str, Any]:
    """The baseline, in this process (the child ``--trl`` runs); tokens/s over the steps
    after the first."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    torch.set_num_threads(THREADS)
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    rows = []
    for line in data.read_text().splitlines():
        pair = json.loads(line)
        rows.append(
            {
                "prompt": pair["input"]["messages"],
                "chosen": pair["preferred_output"],
                "rejected": pair["non_preferred_output"],
            }
        )
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    # the policy's forward passes, not the reference's
    seen, marks, clock = token_clock(model, grad_only=True)

    with tempfile.TemporaryDirectory() as out:
        config = DPOConfig(
            output_dir=out,
            beta=BETA,
            max_length=args.max_seq_len,
            per_device_train_batch_size=args.micro_batch,
            gradient_accumulation_steps=args.accum,
            learning_rate=LEARNING_RATE,
            max_steps=args.steps,
            logging_steps=args.steps,
            gradient_checkpointing=checkpointing,
            optim="adamw_torch",
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            seed=args.seed,
            dataloader_num_workers=0,
        )
        trainer = DPOTrainer(
            model=model,
            args=config,
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
            peft_config=LoraConfig(
                r=LORA["r"],
                lora_alpha=LORA["alpha"],
                lora_dropout=LORA["dropout"],
                target_modules=LORA["target_modules"],
                task_type="CAUSAL_LM",
            ),
            callbacks=[clock],
        )
        trainer.train()
    (t0, n0), (t1, n1) = marks[0], marks[-1]
    return {
        "tokens_per_s": (n1 - n0) / (t1 - t0),
        "timed_steps": len(marks) - 1,
        "timed_tokens": n1 - n0,
        "real_share_of_computed_tokens": seen["tokens"] / max(seen["padded"], 1),
        "peak_memory_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "gradient_checkpointing": checkpointing,
        "trl_version": __import__("trl").__version__,
    }


def main() -> None:
    parser = workload_parser(
        __doc__.splitlines()[0], steps=6, micro_batch=4, accum=2, max_seq_len=256
    )
    parser.add_argument("--rounds", type=int, default=2, help="alternating TRL/TuneFleet runs")
    parser.add_argument("--trl", nargs=3, metavar=("MODEL", "DATA", "CKPT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl:  # the child: TRL alone, its figures on stdout's last line
        model, pairs, ckpt = args.trl
        print(json.dumps(run_trl(Path(model), Path(pairs), args, ckpt == "on")))
        return

    from tunefleet.platform.models import ModelRegistry
    from tunefleet.platform.settings import get_settings
    from tunefleet.workers.model_registry import prepare_builtin

    model_path = prepare_builtin(ModelRegistry(get_settings().resolved_model_registry))
    data = Path(tempfile.mkdtemp(prefix="tf-bench-data-")) / "pairs.jsonl"
    make_pairs(data, args.examples, max_words=int(args.max_seq_len * 0.6), seed=args.seed)
    dpo = {
        "type": "dpo",
        "dpo": {
            "hyperparameters": {
                "n_epochs": 1,
                "batch_size": args.micro_batch * args.accum,
                "beta": BETA,
            }
        },
    }
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        setting: {"trl": [], "tunefleet": []}
        for setting in ("checkpointing_on", "checkpointing_off")
    }
    for _ in range(args.rounds):
        for setting, side in runs.items():
            on = setting == "checkpointing_on"
            child = subprocess.run(
                [sys.executable, __file__, *sys.argv[1:], "--trl", str(model_path), str(data),
                 "on" if on else "off"],
                capture_output=True,
                text=True,
                check=False,
            )  # fmt: skip
            if child.returncode:
                raise RuntimeError(f"the TRL run failed:\n{child.stderr[-4000:]}")
            side["trl"].append(json.loads(child.stdout.strip().splitlines()[-1]))
            # fp32, as the TRL side trains: the same precision on both sides
            options = {"packing": False, "gradient_checkpointing": on, "precision": "fp32"}
            side["tunefleet"].append(
                run_tunefleet(model_path, data, args, options, method=dpo, file_format="preference")
            )

    def median(runs: list[dict[str, Any]], key: str) -> float:
        return float(statistics.median(r[key] for r in runs))

    ratios = {}
    for setting, side in runs.items():
        speed = median(side["tunefleet"], "tokens_per_s") / median(side["trl"], "tokens_per_s")
        memory = median(side["tunefleet"], "peak_memory_bytes") / median(
            side["trl"], "peak_memory_bytes"
        )
        ratios[setting] = {
            "tokens_per_s_ratio_vs_trl": speed,
            "peak_memory_ratio_vs_trl": memory,
            "ratio_met": speed >= TARGET_RATIO,
            "memory_met": memory <= 1.0,
        }
    result = {
        "model": "SmolLM2-135M-Instruct",
        "lora": LORA,
        "beta": BETA,
        "steps": args.steps,
        "micro_batch_pairs": args.micro_batch,
        "accumulation": args.accum,
        "max_seq_len": args.max_seq_len,
        "pairs": args.examples,
        "threads": THREADS,
        "precision": "fp32",
        "machine": machine.describe(),
        "rounds": args.rounds,
        "runs": runs,
        "medians_ratio": ratios,
        "target": {"tokens_per_s_ratio": TARGET_RATIO, "peak_memory_ratio": 1.0},
    }
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
