"""Efficacy of the defaults: what a job that leaves everything at "auto" learns, against a
small grid of hand-set configurations, on four held-out tasks (``efficacy_tasks.py``).

Every configuration is a real job (``create_job``, the API's own builder: whatever
"auto" and the defaults settle on is what a user gets) trained by the real driver on a
local Ray cluster (one worker, 2 CPUs), on the bundled SmolLM2-135M-Instruct. Each adapter
is then loaded by peft from the artifact store (not by TuneFleet's server) and answers the
task's held-out prompts greedily; the task's scorer counts the right answers.

- ``defaults``: nothing set but the worker's CPUs: the platform's defaults as they are;
- ``all-linear r16 width-fit lr (previous defaults)``: the defaults before rank 32;
- ``old defaults``: the defaults before this suite (LoRA r=8, alpha 16 on q/k/v/o,
  learning rate 2e-4, batch 4, 3 epochs), set by hand;
- the grid: LoRA targets (attention only, all linear layers), rank, learning rate and
  epochs, one or two at a time around the literature's recipe;
- ``plain peft`` (the format task): a plain peft + torch loop with the settings a user
  found better than the old defaults (r=16 on all linear layers, lr 3e-4, batch 8, 3
  epochs), the figure the defaults must reach.

Each seed draws the tasks' data (other examples, other held-out prompts) and the jobs'
seed: one seed's score moves by 10-20 points between neighbouring configurations, so a
configuration's figure is its mean over the seeds (``--seeds``, default 7 8 9).

Per task: each configuration's mean score, every seed's score and the mean training time,
the best grid score, the gap from the defaults to it. Targets: the defaults within 5
points of the best grid configuration on every task, and at or above plain peft on the
format task.

    .venv/bin/python bench/efficacy.py    # ~50 min a seed for the whole grid
    .venv/bin/python bench/efficacy.py --seeds 9 --add-to bench/results/efficacy.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import machine
from efficacy_tasks import Task, tasks

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "efficacy.json"
THREADS = 2
TARGET_GAP = 5.0  # points below the best grid configuration, at most
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL_LINEAR = [*ATTENTION, "gate_proj", "up_proj", "down_proj"]


def _config(
    targets: list[str], r: int, lr: float | None, epochs: int = 3, batch: int = 4
) -> dict[str, Any]:
    return {
        "lora": {"r": r, "alpha": 2 * r, "dropout": 0.05, "target_modules": targets},
        "learning_rate": lr,
        "hyperparameters": {"n_epochs": epochs, "batch_size": batch},
    }


# name -> what the job sets (None: nothing, the defaults)
CONFIGS: dict[str, dict[str, Any] | None] = {
    "defaults": None,
    "old defaults": {
        **_config(ATTENTION, 8, 2e-4),
        "lora": {"r": 8, "alpha": 16, "dropout": 0.05, "target_modules": ATTENTION},
    },
    "attention r16 lr1e-3": _config(ATTENTION, 16, 1e-3),
    "all-linear r16 width-fit lr (previous defaults)": _config(ALL_LINEAR, 16, None),
    "all-linear r16 lr2e-4": _config(ALL_LINEAR, 16, 2e-4),
    "all-linear r16 lr5e-4": _config(ALL_LINEAR, 16, 5e-4),
    "all-linear r32 lr1e-3": _config(ALL_LINEAR, 32, 1e-3),
    "all-linear r16 lr2e-3": _config(ALL_LINEAR, 16, 2e-3),
    "all-linear r16 lr1e-3 2 epochs": _config(ALL_LINEAR, 16, 1e-3, epochs=2),
}
NOT_GRID = ("defaults", "old defaults")


class Platform:
    """One database, tenant and local Ray cluster for every job of the run."""

    def __init__(self, model_path: Path) -> None:
        import ray

        from tunefleet.platform.artifacts import ArtifactStore
        from tunefleet.platform.db import session_scope
        from tunefleet.platform.db.migrate import upgrade
        from tunefleet.platform.settings import get_settings
        from tunefleet.platform.tenants import authenticate, create_key, create_tenant

        self.model_path = model_path
        self.work = Path(tempfile.mkdtemp(prefix="tf-efficacy-"))
        self.url = f"sqlite:///{self.work / 'db.sqlite'}"
        os.environ.update(
            TUNEFLEET_DATA_DIR=str(self.work),
            TUNEFLEET_DATABASE_URL=self.url,
            TUNEFLEET_MODEL_REGISTRY=str(model_path.parent),
        )
        get_settings.cache_clear()
        upgrade(self.url)
        self.store = ArtifactStore(self.work / "artifacts")
        with session_scope(self.url) as s:
            tenant = create_tenant(s, "efficacy")
            self.key = create_key(s, tenant.id)[1]
            self.tenant_id = authenticate(s, f"Bearer {self.key}").tenant_id
        ray.init(num_cpus=THREADS, include_dashboard=False, log_to_driver=False)

    def upload(self, task: Task, seed: int) -> str:
        """The task's training file, stored and recorded as the API's upload would."""
        from tunefleet.platform.db import File, session_scope

        file_id = f"file-{task.name}-{seed}"
        body = "".join(json.dumps(row) + "\n" for row in task.train).encode()
        self.store.write_bytes(self.store.file_key(file_id), body)
        with session_scope(self.url) as s:
            s.add(File(id=file_id, tenant_id=self.tenant_id, filename=f"{task.name}.jsonl",
                       purpose="fine-tune", bytes=len(body), status="processed",
                       format="chat", stats={"examples": len(task.train)},
                       path=self.store.file_key(file_id)))  # fmt: skip
        return file_id

    def train(self, file_id: str, config: dict[str, Any] | None, seed: int) -> dict[str, Any]:
        """One job with ``config`` (None: the defaults) on ``file_id``, run to its end:
        its id, what it settled on, its training time and loss."""
        from sqlalchemy import select

        from tunefleet.platform._defaults import base_learning_rate
        from tunefleet.platform.db import Job, JobEvent, session_scope
        from tunefleet.platform.jobs import JobCreateRequest, create_job
        from tunefleet.platform.models import BUILTIN_MODEL, ModelRegistry
        from tunefleet.platform.planner import PlanDevice
        from tunefleet.platform.settings import get_settings
        from tunefleet.platform.spec import BASE_LEARNING_RATE
        from tunefleet.platform.tenants import authenticate
        from tunefleet.workers.backend import RayBackend
        from tunefleet.workers.controller import Controller

        body: dict[str, Any] = {"model": BUILTIN_MODEL, "training_file": file_id, "seed": seed}
        options: dict[str, Any] = {"resources": {"num_workers": 1, "cpus_per_worker": THREADS}}
        if config is not None:
            body["hyperparameters"] = dict(config["hyperparameters"])
            if config["learning_rate"] is not None:  # the multiplier giving it on this model
                model_config = json.loads((self.model_path / "config.json").read_text())
                body["hyperparameters"]["learning_rate_multiplier"] = (
                    config["learning_rate"] / base_learning_rate("lora", model_config)[0]
                )
            options["lora"] = config["lora"]
        body["tunefleet"] = options
        settings = get_settings()
        with session_scope(self.url) as s:
            principal = authenticate(s, f"Bearer {self.key}")
            device = PlanDevice.from_gb(settings.device_memory_gb, settings.host_memory_gb)
            job_id = create_job(
                s, principal, JobCreateRequest.model_validate(body),
                ModelRegistry(self.model_path.parent), device=device,
            ).id  # fmt: skip
        started = time.perf_counter()
        Controller(settings, RayBackend(settings)).run_in_process(job_id, f"{job_id}-1")
        seconds = time.perf_counter() - started
        with session_scope(self.url) as s:
            job = s.get(Job, job_id)
            assert job is not None
            spec = job.spec
            losses = [
                e.data["train_loss"]
                for e in s.scalars(
                    select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.type == "metrics")
                )
            ]
        adapter = self.store.local_copy(self.store.adapter_key(job_id))
        opts = spec["tunefleet"]
        return {
            "job": job_id,
            "adapter": str(adapter),
            "train_seconds": round(seconds, 1),
            "steps": len(losses),
            "final_train_loss": round(losses[-1], 4) if losses else None,
            "settled": {
                **spec["hyperparameters"],
                "learning_rate": (
                    spec.get("base_learning_rate") or BASE_LEARNING_RATE[opts["method"]]
                )
                * spec["hyperparameters"]["learning_rate_multiplier"],
                "lora": opts["lora"],
            },
        }


def plain_peft(model_path: Path, task: Task, seed: int) -> dict[str, Any]:
    """The user's own loop: peft LoRA r=16 (alpha 32) on every linear layer, AdamW at 3e-4
    decaying linearly, batches of 8 padded examples, 3 epochs, loss on the answers."""
    import random

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tunefleet.workers.train.data import IGNORE, load_dataset

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "train.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in task.train))
        examples = load_dataset(path, tokenizer, 512).examples
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model = get_peft_model(
        model,
        LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=ALL_LINEAR,
                   task_type="CAUSAL_LM"),
    )  # fmt: skip
    batch, epochs = 8, 3
    steps = epochs * -(-len(examples) // batch)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-4)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / steps)
    rnd = random.Random(seed)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    started = time.perf_counter()
    model.train()
    for _ in range(epochs):
        order = list(range(len(examples)))
        rnd.shuffle(order)
        for i in range(0, len(order), batch):
            rows = [examples[j] for j in order[i : i + batch]]
            width = max(len(r.input_ids) for r in rows)
            ids = torch.tensor([r.input_ids + [pad] * (width - len(r.input_ids)) for r in rows])
            labels = torch.tensor([r.labels + [IGNORE] * (width - len(r.labels)) for r in rows])
            mask = torch.tensor([[1] * len(r.input_ids) + [0] * (width - len(r.input_ids))
                                 for r in rows])  # fmt: skip
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
    seconds = time.perf_counter() - started
    out = Path(tempfile.mkdtemp(prefix="tf-efficacy-peft-"))
    model.save_pretrained(out)
    return {"adapter": str(out), "train_seconds": round(seconds, 1), "steps": steps}


def answers(model_path: Path, adapter: str | None, task: Task) -> list[str]:
    """Greedy answers to the task's held-out prompts, from the base or base + ``adapter``
    (loaded by peft), in one left-padded batch."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.padding_side = "left"
    model: Any = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        for p, _ in task.heldout
    ]
    out: list[str] = []
    for i in range(0, len(prompts), 32):
        batch = tokenizer(prompts[i : i + 32], return_tensors="pt", padding=True,
                          add_special_tokens=False)  # fmt: skip
        with torch.no_grad():
            made = model.generate(**batch, max_new_tokens=task.max_new_tokens, do_sample=False)
        width = batch["input_ids"].shape[1]
        out += tokenizer.batch_decode(made[:, width:], skip_special_tokens=True)
    return out


def score(task: Task, said: list[str]) -> float:
    right = sum(task.score(a, want) for a, (_, want) in zip(said, task.heldout, strict=True))
    return round(100.0 * right / len(task.heldout), 1)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["tasks"])
    shown = ["base model", "old defaults", "defaults", "best grid", "plain peft"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(shown)
    for k, label in enumerate(shown):
        values = []
        for name in names:
            t = results["tasks"][name]
            value = (
                t["best_grid_score"]
                if label == "best grid"
                else t["configs"].get(label, {}).get("score")
            )
            values.append(float("nan") if value is None else value)
        ax.bar([i + k * width for i in range(len(names))], values, width, label=label)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))])
    ax.set_xticklabels([f"{n}\n({results['tasks'][n]['kind']})" for n in names])
    ax.set_ylabel("held-out score (%)")
    ax.set_ylim(0, 105)
    seeds = ", ".join(str(seed) for seed in results["seeds"])
    ax.set_title(f"SmolLM2-135M-Instruct, LoRA: defaults vs grid, mean of seeds {seeds} "
                 f"({results['machine']})", fontsize=9)  # fmt: skip
    ax.legend(fontsize=8, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.18))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summary(runs: dict[str, dict[int, dict[str, Any]]]) -> dict[str, Any]:
    """A task's configurations over the seeds run so far: each one's mean score (the
    figure compared) and mean training time, with every seed's run; the best grid
    configuration by mean and the defaults' gap to it."""
    rows: dict[str, Any] = {}
    for name, by_seed in runs.items():
        scores = {seed: run["score"] for seed, run in by_seed.items()}
        times = [run["train_seconds"] for run in by_seed.values() if "train_seconds" in run]
        rows[name] = {
            "score": round(sum(scores.values()) / len(scores), 1),
            "scores": scores,
            **({"train_seconds": round(sum(times) / len(times), 1)} if times else {}),
            "runs": by_seed,
        }
    grid = {k: v["score"] for k, v in rows.items() if k in CONFIGS and k not in NOT_GRID}
    best = max(grid, key=lambda k: grid[k]) if grid else None
    entry: dict[str, Any] = {
        "configs": rows,
        "best_grid": best,
        "best_grid_score": grid[best] if best else None,
    }
    if best and "defaults" in rows:
        entry["defaults_gap_points"] = round(grid[best] - rows["defaults"]["score"], 1)
        entry["defaults_within_target"] = entry["defaults_gap_points"] <= TARGET_GAP
    if "plain peft" in rows and "defaults" in rows:
        entry["defaults_at_or_above_plain_peft"] = (
            rows["defaults"]["score"] >= rows["plain peft"]["score"]
        )
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="*", help="only these tasks (default: all)")
    parser.add_argument("--configs", nargs="*", help="only these configurations")
    parser.add_argument("--n-train", type=int, default=40)
    parser.add_argument("--n-heldout", type=int, default=60)
    parser.add_argument("--seeds", type=int, nargs="+", default=[7, 8, 9],
                        help="each seed draws the tasks' data and the jobs' seed")  # fmt: skip
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--add-to", type=Path,
                        help="a results file whose runs this run adds to (its seeds, n-train "
                        "and n-heldout): a run in parts")  # fmt: skip
    args = parser.parse_args()

    sys.path.insert(0, str(ROOT / "workers"))
    import torch

    from tunefleet.platform.models import ModelRegistry
    from tunefleet.platform.settings import get_settings
    from tunefleet.workers.model_registry import prepare_builtin

    torch.set_num_threads(THREADS)
    model_path = prepare_builtin(ModelRegistry(get_settings().resolved_model_registry))
    configs = {k: v for k, v in CONFIGS.items() if not args.configs or k in args.configs}
    platform = Platform(model_path)
    results: dict[str, Any] = {
        "machine": machine.describe(),
        "model": model_path.name,
        "n_train": args.n_train,
        "n_heldout": args.n_heldout,
        "seeds": args.seeds,
        "target_gap_points": TARGET_GAP,
        "tasks": {},
    }
    runs: dict[str, dict[str, dict[int, dict[str, Any]]]] = {}
    if args.add_to:
        before = json.loads(args.add_to.read_text())
        if (before["n_train"], before["n_heldout"]) != (args.n_train, args.n_heldout):
            sys.exit(f"{args.add_to} has n-train {before['n_train']}, n-heldout "
                     f"{before['n_heldout']}: run with those to add to it")  # fmt: skip
        for name, task in before["tasks"].items():
            runs[name] = {config: {int(seed): run for seed, run in row["runs"].items()}
                          for config, row in task["configs"].items()}  # fmt: skip
        results["tasks"] = before["tasks"]
        results["seeds"] = sorted({*before["seeds"], *args.seeds})
    for seed in args.seeds:
        suite = [t for t in tasks(seed, args.n_train, args.n_heldout)
                 if not args.tasks or t.name in args.tasks]  # fmt: skip
        for task in suite:
            file_id = platform.upload(task, seed)
            said = answers(model_path, None, task)
            done = runs.setdefault(task.name, {})
            done.setdefault("base model", {})[seed] = {"score": score(task, said),
                                                       "sample": said[:3]}  # fmt: skip
            for name, config in configs.items():
                row = platform.train(file_id, config, seed)
                said = answers(model_path, row.pop("adapter"), task)
                done.setdefault(name, {})[seed] = {"score": score(task, said), **row,
                                                   "sample": said[:3]}  # fmt: skip
                print(f"{seed} {task.name:9s} {name:36s} {done[name][seed]['score']:5.1f}  "
                      f"{row['train_seconds']:6.1f}s", flush=True)  # fmt: skip
            if task.name == "format" and (not args.configs or "plain peft" in args.configs):
                row = plain_peft(model_path, task, seed)
                said = answers(model_path, row.pop("adapter"), task)
                done.setdefault("plain peft", {})[seed] = {"score": score(task, said), **row,
                                                           "sample": said[:3]}  # fmt: skip
                print(f"{seed} {task.name:9s} {'plain peft':36s} "
                      f"{done['plain peft'][seed]['score']:5.1f}", flush=True)  # fmt: skip
            results["tasks"][task.name] = {
                "kind": task.kind,
                "train_examples": len(task.train),
                "heldout_prompts": len(task.heldout),
                **summary(done),
            }
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=2) + "\n")
    results["target_met"] = all(
        t.get("defaults_within_target", False) and t.get("defaults_at_or_above_plain_peft", True)
        for t in results["tasks"].values()
    )
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.out.with_suffix(".png"))
    print(json.dumps({k: {c: v["score"] for c, v in t["configs"].items()}
                      for k, t in results["tasks"].items()}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
