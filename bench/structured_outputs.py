"""The throughput cost of structured outputs: constrained decoding against unconstrained,
in the same batched multi-LoRA engine, on SmolLM2-135M, in one run.

The workload: ``--requests`` greedy requests over ``--adapters`` distinct adapters (LoRA
r=16 on q/k/v/o, random B; request i uses adapter ``i % N``), decoded as one continuous
batch, each generating exactly ``--new-tokens`` tokens (end of text ignored). Constrained,
every request carries a ``json_schema`` response format (a list of at least 50 records,
each with a bounded name, an integer, an enum and a boolean: the grammar never completes
within the budget, so every row does the same work as unconstrained and the masks cover
structure, not just string content). Both run ``--repeats`` times in alternation and the
best rate of each is kept (the machine is shared). Also: compiling a schema (first time,
then from the replica's cache) and the grammar engine's one-off vocabulary build.

Writes ``bench/results/structured_outputs.json``; the target of issue 20 (constrained at
most 20% slower at 32 adapters) is checked and printed, not asserted.

    .venv/bin/python bench/structured_outputs.py            # ~2 min on 2 CPU cores
    .venv/bin/python bench/structured_outputs.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import machine  # noqa: E402
from serve_multilora import TARGETS, make_prompts  # noqa: E402
from tinyllm import save_random_lora  # noqa: E402
from tunefleet.platform.models import ModelRegistry  # noqa: E402
from tunefleet.platform.settings import get_settings  # noqa: E402
from tunefleet.workers.model_registry import prepare_builtin  # noqa: E402
from tunefleet.workers.serve._adapter_cache import AdapterCache  # noqa: E402
from tunefleet.workers.serve._adapters import load_serving_base  # noqa: E402
from tunefleet.workers.serve._engine import BatchEngine, generate_all  # noqa: E402
from tunefleet.workers.serve._generate import Sampling  # noqa: E402
from tunefleet.workers.serve._multilora import MultiLoraModel  # noqa: E402
from tunefleet.workers.serve._structured import Grammars  # noqa: E402

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "records": {
            "type": "array",
            "minItems": 50,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 12},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "kind": {"enum": ["cat", "dog", "bird", "fish"]},
                    "ok": {"type": "boolean"},
                },
                "required": ["name", "age", "kind", "ok"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["records"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "records", "schema": SCHEMA}}


def run(engine: BatchEngine, tokenizer: Any, items: list[Any], new: int) -> float:
    generate_all(engine, tokenizer, [(items[0][0], Sampling(2, 0), items[0][2])])  # warm-up
    started = time.perf_counter()
    done = generate_all(engine, tokenizer, items)
    elapsed = time.perf_counter() - started
    assert all(d.completion_tokens == new for d in done), [d.completion_tokens for d in done]
    return len(items) * new / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.adapters, args.new_tokens, args.repeats = 8, 4, 8, 1

    from transformers import AutoTokenizer

    model_path = prepare_builtin(ModelRegistry(get_settings().resolved_model_registry))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = make_prompts(tokenizer, args.requests)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        base = load_serving_base(model_path)
        for i in range(args.adapters):
            save_random_lora(
                base, folder / f"ad{i}", r=16, alpha=32, targets=TARGETS, seed=i, std=0.02
            )
        lora = MultiLoraModel(base, max_adapters=args.adapters)
        cache = AdapterCache(lora, locate=lambda a: folder / a)
        slots = [cache.acquire(f"ad{i % args.adapters}", hold=False) for i in range(len(prompts))]
        grammars = Grammars(tokenizer, set())
        started = time.perf_counter()
        _ = grammars.tokenizer
        vocabulary_s = time.perf_counter() - started
        started = time.perf_counter()
        grammar = grammars.compile(RESPONSE_FORMAT)
        compile_s = time.perf_counter() - started
        started = time.perf_counter()
        grammars.compile(RESPONSE_FORMAT)
        cached_s = time.perf_counter() - started
        started = time.perf_counter()
        for _ in range(len(prompts)):
            grammars.matcher(grammar)
        matcher_s = (time.perf_counter() - started) / len(prompts)
        # no end-of-text tokens: every row decodes exactly --new-tokens
        engine = BatchEngine(lora, set(), max_batch_size=len(prompts), grammars=grammars)
        plain = Sampling(max_tokens=args.new_tokens, temperature=0)
        shaped = Sampling(max_tokens=args.new_tokens, temperature=0, grammar=grammar)
        rates = {"unconstrained": 0.0, "json_schema": 0.0}
        sample = ""
        for rep in range(args.repeats):
            with torch.inference_mode():
                free = run(
                    engine,
                    tokenizer,
                    [(p, plain, s) for p, s in zip(prompts, slots, strict=True)],
                    args.new_tokens,
                )
                items = [(p, shaped, s) for p, s in zip(prompts, slots, strict=True)]
                bound = run(engine, tokenizer, items, args.new_tokens)
            rates["unconstrained"] = max(rates["unconstrained"], free)
            rates["json_schema"] = max(rates["json_schema"], bound)
            print(
                f"[{rep}] unconstrained {free:.1f} tok/s, json_schema {bound:.1f} tok/s", flush=True
            )
        sample = generate_all(engine, tokenizer, [(prompts[0], shaped, slots[0])])[0].text
    slower = 1 - rates["json_schema"] / rates["unconstrained"]
    result = {
        "machine": machine.describe(),
        "model": model_path.name,
        "requests": args.requests,
        "adapters": args.adapters,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "tokens_per_s": {k: round(v, 1) for k, v in rates.items()},
        "constrained_slower_by": round(slower, 4),
        "grammar_vocabulary_build_s": round(vocabulary_s, 3),
        "schema_compile_ms": round(compile_s * 1000, 2),
        "schema_compile_cached_ms": round(cached_s * 1000, 3),
        "matcher_start_ms": round(matcher_s * 1000, 3),
        "sample_output": sample[:200],
        "targets": {f"json_schema at most 20% slower at {args.adapters} adapters": slower <= 0.20},
    }
    out = ROOT / "bench" / "results" / "structured_outputs.json"
    if not args.quick:
        out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
