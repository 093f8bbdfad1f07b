"""The serving engine's two CPU kernels against what they replace, on SmolLM2-135M:

- **packed linears**: the ``serve_multilora`` workload at 32 distinct adapters (128
  greedy requests, 32 new tokens each) through the engine with every linear layer packed
  for oneDNN (``MultiLoraModel(pack_weights=True)``, the default) and with plain
  ``nn.Linear`` (MKL sgemm), alternated; generated tokens/s and whether both decode the
  same tokens;
- **KV cache**: 32 decode steps of 16 rows after 768-token prompts, with the engine's
  ``BatchCache`` (in-place writes into preallocated blocks) and with transformers'
  ``DynamicCache`` (a concatenation of every layer's keys and values per step), both
  started from the same prefilled states; seconds per step.

Every configuration runs ``--repeats`` times in alternation and the best is kept (the
machine is shared). Writes ``bench/results/serve_kernels.json``.

    .venv/bin/python bench/serve_kernels.py            # ~5 min on 2 CPU cores
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

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from serve_multilora import TARGETS, make_prompts, save_random_lora  # noqa: E402
from tunefleet.platform.models import BUILTIN_MODEL, ModelRegistry  # noqa: E402
from tunefleet.platform.settings import get_settings  # noqa: E402
from tunefleet.workers.model_registry import prepare_builtin  # noqa: E402
from tunefleet.workers.serve._adapter_cache import AdapterCache  # noqa: E402
from tunefleet.workers.serve._adapters import load_serving_base  # noqa: E402
from tunefleet.workers.serve._engine import BatchEngine, generate_all  # noqa: E402
from tunefleet.workers.serve._generate import Sampling  # noqa: E402
from tunefleet.workers.serve._kvcache import BatchCache  # noqa: E402
from tunefleet.workers.serve._multilora import MultiLoraModel  # noqa: E402


def packed_vs_plain(
    model_path: Path, tokenizer: Any, adapters: int, requests: int, new: int, repeats: int
) -> dict[str, Any]:
    prompts = make_prompts(tokenizer, requests)
    sampling = Sampling(max_tokens=new, temperature=0)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        base = load_serving_base(model_path)
        for i in range(adapters):
            save_random_lora(
                base, folder / f"ad{i}", r=16, alpha=32, targets=TARGETS, seed=i, std=0.02
            )
        engines = {}
        for kind in ("packed", "plain"):
            lora = MultiLoraModel(
                load_serving_base(model_path), max_adapters=adapters, pack_weights=kind == "packed"
            )
            cache = AdapterCache(lora, locate=lambda a: folder / a)
            slots = [cache.acquire(f"ad{i % adapters}", hold=False) for i in range(requests)]
            engines[kind] = (BatchEngine(lora, set(), max_batch_size=requests), slots)
        rates: dict[str, float] = {}
        tokens: dict[str, list[list[int]]] = {}
        for rep in range(repeats):
            for kind, (engine, slots) in engines.items():
                generate_all(engine, tokenizer, [(prompts[0], Sampling(2, 0), slots[0])])
                started = time.perf_counter()
                items = [(p, sampling, s) for p, s in zip(prompts, slots, strict=True)]
                done = generate_all(engine, tokenizer, items)
                rate = requests * new / (time.perf_counter() - started)
                rates[kind] = max(rates.get(kind, 0.0), rate)
                tokens[kind] = [d.token_ids for d in done]
                print(f"[{rep}] {kind} linears: {rate:.1f} tok/s", flush=True)
    same = sum(a == b for a, b in zip(tokens["packed"], tokens["plain"], strict=True))
    return {
        "adapters": adapters,
        "requests": requests,
        "new_tokens": new,
        "tokens_per_s": {k: round(v, 2) for k, v in rates.items()},
        "speedup": round(rates["packed"] / rates["plain"], 4),
        "requests_with_identical_tokens": same,
    }


def kv_cache(model_path: Path, rows: int, context: int, steps: int, repeats: int) -> dict[str, Any]:
    from transformers import DynamicCache

    model = load_serving_base(model_path)
    ids = torch.randint(100, 10_000, (rows, context), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        prefilled = DynamicCache()
        out = model(input_ids=ids, past_key_values=prefilled, use_cache=True, logits_to_keep=1)
    first = out.logits[:, -1].argmax(-1, keepdim=True)
    states = [(layer.keys, layer.values) for layer in prefilled.layers]

    def decode(kind: str) -> tuple[float, list[int]]:
        cache: Any = DynamicCache() if kind == "DynamicCache" else BatchCache()
        for i, (k, v) in enumerate(states):
            cache.update(k.clone(), v.clone(), i)
        mask = torch.ones(rows, context, dtype=torch.long)
        token, picked = first, []
        with torch.inference_mode():
            started = time.perf_counter()
            for s in range(steps):
                mask = torch.cat([mask, mask.new_ones(rows, 1)], dim=1)
                out = model(
                    input_ids=token,
                    attention_mask=mask,
                    position_ids=torch.full((rows, 1), context + s),
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
                token = out.logits[:, -1].argmax(-1, keepdim=True)
                picked.append(int(token[0]))
            return (time.perf_counter() - started) / steps, picked

    best: dict[str, float] = {}
    picks: dict[str, list[int]] = {}
    for rep in range(repeats):
        for kind in ("BatchCache", "DynamicCache"):
            per_step, picks[kind] = decode(kind)
            best[kind] = min(best.get(kind, float("inf")), per_step)
            print(f"[{rep}] {kind}: {per_step * 1000:.0f} ms per step", flush=True)
    return {
        "rows": rows,
        "context": context,
        "steps": steps,
        "seconds_per_step": {k: round(v, 4) for k, v in best.items()},
        "speedup": round(best["DynamicCache"] / best["BatchCache"], 4),
        "same_tokens": picks["BatchCache"] == picks["DynamicCache"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    model_path = prepare_builtin(ModelRegistry(get_settings().resolved_model_registry))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if args.quick:
        args.repeats = 1
        packed = packed_vs_plain(model_path, tokenizer, 4, 8, 4, args.repeats)
        kv = kv_cache(model_path, 2, 64, 4, args.repeats)
    else:
        packed = packed_vs_plain(model_path, tokenizer, 32, 128, 32, args.repeats)
        kv = kv_cache(model_path, 16, 768, 32, args.repeats)
    result = {
        "model": BUILTIN_MODEL,
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "packed_linears": packed,
        "kv_cache": kv,
    }
    name = "serve_kernels_quick.json" if args.quick else "serve_kernels.json"
    (ROOT / "results" / name).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
