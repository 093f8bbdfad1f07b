"""Eval throughput (issue 41): items per second with 4 fine-tuned models of one base,
sampled by 4 eval runs created at once, against the same requests sent to the chat API
one at a time, model after model (what a script over ``client.chat.completions`` does).

The stack is ``tunefleet up`` as a user runs it (local Ray, the built-in
SmolLM2-135M-Instruct) in a data folder of its own. 4 random LoRA adapters (r=16 on
q/k/v/o, random B so each changes the answers) are uploaded and imported as the bootstrap
tenant's models. The items are the demo's questions (training and held-out), ``--items``
of them per model. Both paths send the same requests: the same messages, greedy
(temperature 0), ``max_completion_tokens`` ``--new-tokens``. An eval run's requests go
through the controller's eval step (``workers/_evals.py``, 16 in flight per run), so the
4 runs' requests share the multi-LoRA engine's batches.

Each path runs ``--repeats`` times in alternation and the best rate is kept (the machine
is shared). Items per second and generated tokens per second are both written (greedy
answers may end at slightly different lengths in a batch than alone: the tokens say what
work was done). Writes ``bench/results/evals.json``; the target (at least 3x items per
second) is checked and printed, not asserted.

    .venv/bin/python bench/evals.py            # ~10 min on 2 CPU cores
    .venv/bin/python bench/evals.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import machine  # noqa: E402
from raycluster import free_port, stop_process  # noqa: E402
from tinyllm import save_random_lora  # noqa: E402
from tunefleet.cli._demo import DATA  # noqa: E402
from tunefleet.platform.models import BUILTIN_MODEL  # noqa: E402

MODELS = 4
TARGET = 3.0


def questions(n: int) -> list[str]:
    train = [json.loads(line) for line in (DATA / "demo_train.jsonl").read_text().splitlines()]
    heldout: list[str] = json.loads((DATA / "demo_heldout.json").read_text())
    asked = [t["messages"][0]["content"] for t in train] + heldout
    return (asked * (n // len(asked) + 1))[:n]


def start_stack(data: Path) -> tuple[subprocess.Popen[bytes], str, str, Path]:
    """``tunefleet up`` in ``data``: the process, the API's URL, the bootstrap admin key
    and the model registry."""
    registry = data / "models"
    env = {
        **os.environ,
        "TUNEFLEET_DATA_DIR": str(data),
        "TUNEFLEET_MODEL_REGISTRY": str(registry),
        "TUNEFLEET_API_PORT": str(free_port()),
        "TUNEFLEET_SERVE_PORT": str(free_port()),
        "TUNEFLEET_CONTROLLER_INTERVAL_S": "0.3",
    }
    env.pop("RAY_ADDRESS", None)  # a local Ray of its own
    log_path = data / "up.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tunefleet.cli.main", "up"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 600
    while "Ready. Ctrl-C stops." not in log_path.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_process(proc)
            raise RuntimeError(f"tunefleet up did not start:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.5)
    key = re.search(r"export OPENAI_API_KEY=(tf-\S+)", log_path.read_text())
    assert key, log_path.read_text()[-3000:]
    return proc, f"http://127.0.0.1:{env['TUNEFLEET_API_PORT']}", key.group(1), registry


def import_adapters(client: httpx.Client, base_path: Path, work: Path) -> list[str]:
    """``MODELS`` random adapters of the base, uploaded and imported: their model ids."""
    import torch
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj")
    models = []
    for i in range(MODELS):
        folder = save_random_lora(
            base, work / f"a{i}", r=16, alpha=32, targets=targets, seed=i, std=0.02
        )
        packed = io.BytesIO()
        with tarfile.open(fileobj=packed, mode="w") as tar:
            tar.add(folder, arcname=f"a{i}")
        up = client.post(
            "/v1/files",
            data={"purpose": "adapter"},
            files={"file": (f"a{i}.tar", packed.getvalue())},
        )
        up.raise_for_status()
        made = client.post(
            "/v1/models",
            json={"base_model": BUILTIN_MODEL, "name": f"bench{i}", "file_id": up.json()["id"]},
        )
        made.raise_for_status()
        models.append(made.json()["id"])
    return models


def chat_body(model: str, question: str, new_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "temperature": 0,
        "max_completion_tokens": new_tokens,
    }


def warm(client: httpx.Client, models: list[str], new_tokens: int) -> None:
    """Until every model answers (the controller deploys the base and loads adapters)."""
    deadline = time.monotonic() + 600
    for model in models:
        while True:
            resp = client.post("/v1/chat/completions", json=chat_body(model, "hi", new_tokens))
            if resp.status_code == 200:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{model} never answered: {resp.status_code} {resp.text}")
            time.sleep(2)


def one_after_another(
    client: httpx.Client, models: list[str], asked: list[str], new_tokens: int
) -> dict[str, float]:
    start, tokens = time.perf_counter(), 0
    for model in models:
        for question in asked:
            resp = client.post("/v1/chat/completions", json=chat_body(model, question, new_tokens))
            resp.raise_for_status()
            tokens += resp.json()["usage"]["completion_tokens"]
    took = time.perf_counter() - start
    return {"seconds": took, "items_per_s": len(models) * len(asked) / took, "tokens": tokens}


def eval_runs(
    client: httpx.Client, eval_id: str, models: list[str], asked: list[str], new_tokens: int
) -> dict[str, float]:
    content = [{"item": {"question": q}} for q in asked]
    start = time.perf_counter()
    runs = []
    for model in models:
        made = client.post(
            f"/v1/evals/{eval_id}/runs",
            json={
                "name": model,
                "data_source": {
                    "type": "completions",
                    "model": model,
                    "input_messages": {
                        "type": "template",
                        "template": [{"role": "user", "content": "{{item.question}}"}],
                    },
                    "source": {"type": "file_content", "content": content},
                    "sampling_params": {"temperature": 0, "max_completion_tokens": new_tokens},
                },
            },
        )
        made.raise_for_status()
        runs.append(made.json()["id"])
    pending = set(runs)
    tokens = 0
    while pending:
        time.sleep(0.1)
        for run_id in list(pending):
            run = client.get(f"/v1/evals/{eval_id}/runs/{run_id}").json()
            if run["status"] in ("queued", "in_progress"):
                continue
            if run["status"] != "completed" or run["result_counts"]["errored"]:
                raise RuntimeError(f"eval run {run_id}: {run['status']} {run}")
            tokens += sum(u["completion_tokens"] for u in run["per_model_usage"])
            pending.discard(run_id)
    took = time.perf_counter() - start
    return {"seconds": took, "items_per_s": len(models) * len(asked) / took, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=32, help="questions per model")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="8 items, 8 tokens, once")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/evals.json")
    args = parser.parse_args()
    if args.quick:
        args.items, args.new_tokens, args.repeats = 8, 8, 1
    asked = questions(args.items)
    with tempfile.TemporaryDirectory(prefix="tf-bench-evals-") as tmp:
        proc, url, key, registry = start_stack(Path(tmp))
        try:
            client = httpx.Client(
                base_url=url, timeout=600, headers={"Authorization": f"Bearer {key}"}
            )
            models = import_adapters(client, registry / BUILTIN_MODEL, Path(tmp))
            warm(client, models, args.new_tokens)
            made = client.post(
                "/v1/evals",
                json={
                    "name": "bench",
                    "data_source_config": {
                        "type": "custom",
                        "item_schema": {
                            "type": "object",
                            "properties": {"question": {"type": "string"}},
                        },
                        "include_sample_schema": True,
                    },
                    "testing_criteria": [
                        {
                            "type": "string_check",
                            "name": "answered",
                            "input": "{{sample.output_text}}",
                            "reference": "",
                            "operation": "like",
                        }
                    ],
                },
            )
            made.raise_for_status()
            rounds: dict[str, list[dict[str, float]]] = {"chat_one_after_another": [], "evals": []}
            for _ in range(args.repeats):  # alternated: the machine's noise hits both
                rounds["chat_one_after_another"].append(
                    one_after_another(client, models, asked, args.new_tokens)
                )
                rounds["evals"].append(
                    eval_runs(client, made.json()["id"], models, asked, args.new_tokens)
                )
        finally:
            stop_process(proc, grace_s=60)
    best = {k: max(r["items_per_s"] for r in v) for k, v in rounds.items()}
    ratio = best["evals"] / best["chat_one_after_another"]
    result = {
        "machine": machine.describe(),
        "models": MODELS,
        "items_per_model": args.items,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "rounds": rounds,
        "best_items_per_s": best,
        "ratio": ratio,
        "target": TARGET,
        "met": ratio >= TARGET,
        "command": " ".join(["bench/evals.py", *sys.argv[1:]]),
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["best_items_per_s"]), f"ratio {ratio:.2f}x (target {TARGET}x)")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
