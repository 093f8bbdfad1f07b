"""Multi-LoRA serving throughput: TuneFleet's batched engine against peft, on SmolLM2-135M.

The workload: ``--requests`` greedy requests (prompts of 8-40 tokens), each generating
exactly ``--new-tokens`` tokens (end of text ignored, so every method does the same work);
request i uses adapter ``i % N`` for N distinct adapters (LoRA r=16 on q/k/v/o, random B,
so every adapter changes the outputs). Generated tokens per second for:

- ``tunefleet``: the serving engine, all requests in one continuous batch;
- ``peft_set_adapter``: (a) a plain peft server, ``set_adapter`` then ``generate`` per
  request (timed on a sample of the requests: its rate does not depend on how many);
- ``peft_mixed_batch``: (b) peft's ``adapter_names=`` mixed batch, one ``generate`` over
  every request (left-padded);
- ``merged``: (c) the upper bound, one adapter merged into the base (``merge_and_unload``)
  decoded by the same engine with no LoRA at all.

Every configuration runs ``--repeats`` times in alternation and the best rate is kept
(the machine is shared). Also the cold load of an adapter (artifact folder to ready to
serve) for r=16, median of every load; and its wall time from the local store against
S3 (a real S3 server on 127.0.0.1), on request (the download into an empty node cache
included) and after the replica's prefetch copied the adapter to the node, with the bytes
each path read from S3 during its loads (the store's own counters): the run fails if the
prefetched loads read any. And a new replica's first request (its node's cache empty)
with and without its warm-up of the base model's most requested adapters. Writes
``bench/results/serve_multilora.json`` and a plot ``serve_multilora.png``; the targets of
issues 7, 18 and 44 are checked and printed, not asserted.

``--mixed-ranks-only`` (issue 40): 64 adapters of ranks drawn from {8, 16, 64, 128}
(16 of each, shuffled) in one stream of ``--requests`` requests, under an adapter memory
budget (2 GiB) that 64 adapters of rank 128 would overflow, against the same stream with
every adapter at rank 16, and against the mixed adapters padded to rank 128 in one stack
(what a single-stack kernel does; no budget, as it would not fit). Writes
``bench/results/serve_multilora_mixed_ranks.json``.

    .venv/bin/python bench/serve_multilora.py            # ~10 min on 2 CPU cores
    .venv/bin/python bench/serve_multilora.py --quick    # a smoke run
    .venv/bin/python bench/serve_multilora.py --mixed-ranks-only   # ~10 min
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import machine  # noqa: E402
from tinyllm import save_random_lora  # noqa: E402
from tunefleet.platform.models import BUILTIN_MODEL, ModelRegistry  # noqa: E402
from tunefleet.platform.settings import get_settings  # noqa: E402
from tunefleet.workers.model_registry import prepare_builtin  # noqa: E402
from tunefleet.workers.serve import _multilora  # noqa: E402
from tunefleet.workers.serve._adapter_cache import AdapterCache  # noqa: E402
from tunefleet.workers.serve._adapters import load_serving_base, serving_precision  # noqa: E402
from tunefleet.workers.serve._engine import BatchEngine, generate_all  # noqa: E402
from tunefleet.workers.serve._generate import Sampling  # noqa: E402
from tunefleet.workers.serve._multilora import MultiLoraModel  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
# Where the served base lives: the CPU in fp32 here; bench/gpu_check.py sets a GPU and bf16.
PLACE: dict[str, Any] = {"device": "cpu", "dtype": torch.float32}


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SEEN: set[str] = set()  # the precisions the served bases were in, read from their weights


def serving_base(model_path: Path) -> Any:
    base = load_serving_base(model_path, dtype=PLACE["dtype"]).to(PLACE["device"])
    SEEN.add(next(name for name, d in DTYPES.items() if d == next(base.parameters()).dtype))
    return base


def make_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "a",
        "lazy",
        "dog",
        "while",
        "seven",
        "red",
        "apples",
        "fall",
    ]
    prompts = []
    for i in range(n):
        length = 8 + (i * 7) % 33  # 8..40 tokens, varied
        text = " ".join(words[(i + j) % len(words)] for j in range(length))
        prompts.append(tokenizer(text)["input_ids"][:length])
    return prompts


def run_tunefleet(
    model_path: Path,
    folder: Path,
    prompts: list[list[int]],
    n_adapters: int,
    new: int,
    tokenizer: Any,
) -> float:
    lora = MultiLoraModel(serving_base(model_path), max_adapters=max(n_adapters, 1))
    cache = AdapterCache(lora, locate=lambda a: folder / a)
    engine = BatchEngine(lora, set(), max_batch_size=len(prompts))
    slots = [cache.acquire(f"ad{i % n_adapters}", hold=False) for i in range(len(prompts))]
    sampling = Sampling(max_tokens=new, temperature=0)
    generate_all(engine, tokenizer, [(prompts[0], Sampling(2, 0), slots[0])])  # warm-up
    started = time.perf_counter()
    done = generate_all(
        engine, tokenizer, [(p, sampling, s) for p, s in zip(prompts, slots, strict=True)]
    )
    elapsed = time.perf_counter() - started
    assert all(d.completion_tokens == new for d in done)
    return len(prompts) * new / elapsed


def run_merged(
    model_path: Path, folder: Path, prompts: list[list[int]], new: int, tokenizer: Any
) -> float:
    from peft import PeftModel

    merged = PeftModel.from_pretrained(serving_base(model_path), folder / "ad0").merge_and_unload()
    engine = BatchEngine(MultiLoraModel(merged, max_adapters=1), set(), max_batch_size=len(prompts))
    sampling = Sampling(max_tokens=new, temperature=0)
    generate_all(engine, tokenizer, [(prompts[0], Sampling(2, 0), 0)])
    started = time.perf_counter()
    generate_all(engine, tokenizer, [(p, sampling, 0) for p in prompts])
    return len(prompts) * new / (time.perf_counter() - started)


def _peft_with(model_path: Path, folder: Path, n_adapters: int) -> Any:
    from peft import PeftModel

    model = PeftModel.from_pretrained(serving_base(model_path), folder / "ad0", adapter_name="ad0")
    for i in range(1, n_adapters):
        model.load_adapter(folder / f"ad{i}", adapter_name=f"ad{i}")
    return model.eval()


def _generate(model: Any, batch: list[list[int]], new: int, pad: int, **kwargs: Any) -> None:
    width = max(len(p) for p in batch)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=ids.device)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=pad,
            **kwargs,
        )
    assert out.shape[1] == width + new


def run_peft_set_adapter(
    model: Any, prompts: list[list[int]], n_adapters: int, new: int, pad: int, sample: int
) -> float:
    _generate(model, [prompts[0]], 2, pad)
    started = time.perf_counter()
    for i, p in enumerate(prompts[:sample]):
        model.set_adapter(f"ad{i % n_adapters}")
        _generate(model, [p], new, pad)
    return sample * new / (time.perf_counter() - started)


def run_peft_mixed(
    model: Any, prompts: list[list[int]], n_adapters: int, new: int, pad: int
) -> float:
    names = [f"ad{i % n_adapters}" for i in range(len(prompts))]
    _generate(model, prompts[:2], 2, pad, adapter_names=names[:2])
    started = time.perf_counter()
    _generate(model, prompts, new, pad, adapter_names=names)
    return len(prompts) * new / (time.perf_counter() - started)


def cold_loads(model_path: Path, folder: Path, n: int) -> list[float]:
    lora = MultiLoraModel(serving_base(model_path), max_adapters=n)
    cache = AdapterCache(lora, locate=lambda a: folder / a)
    cache.acquire("ad0", hold=False)  # first load also wraps the layers; not a cold load
    times = []
    for i in range(1, n):
        cache.acquire(f"ad{i}", hold=False)
        times.append(cache.load_time(f"ad{i}"))
    return times


class ReadFromS3(RuntimeError):
    """A prefetched adapter's cold load read from object storage: the prefetch missed."""


def cold_loads_by_store(
    model_path: Path, folder: Path, n: int
) -> tuple[dict[str, list[float]], dict[str, dict[str, int]]]:
    """Wall time of a cold load (an adapter in the artifact store to ready to serve, not
    yet in the replica's memory), adapter by adapter in alternation, and what the loads
    read from S3 (the store's own counters, ``S3Store.fetched``), from:

    - ``local``: the local store;
    - ``s3``: S3 (a real S3 server on 127.0.0.1, moto's) on request, the download into the
      node's empty cache included: an adapter outside the newest ``PREFETCH_ADAPTERS``;
    - ``s3_prefetched``: S3 after the replica's prefetch (``LoraServer.prefetch``, run when
      the controller pushes a new adapter) copied it to the node's cache: what the first
      request for one of the newest adapters of a base model waits for. Raises
      ``ReadFromS3`` if one of these loads read a byte from S3."""
    from s3 import new_bucket, s3_server
    from tunefleet.platform.artifacts import open_store
    from tunefleet.workers.serve.app import LoraServer

    times: dict[str, list[float]] = {"local": [], "s3": [], "s3_prefetched": []}
    read = {name: {"bytes": 0, "objects": 0} for name in times}
    # the local server takes any credentials; a replica has its node's AWS_* variables
    for name, value in (("AWS_ACCESS_KEY_ID", "bench"), ("AWS_SECRET_ACCESS_KEY", "bench")):
        os.environ.setdefault(name, value)
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    with s3_server() as endpoint, tempfile.TemporaryDirectory() as cache_dir:
        bucket = new_bucket(endpoint)
        stores = {
            name: open_store(bucket, endpoint_url=endpoint, cache_dir=Path(cache_dir) / name)
            for name in ("s3", "s3_prefetched")
        }
        # in the store under adapter ids (ftjob-...), as trained ones: the prefetch refuses
        # any other name
        for i in range(n):
            stores["s3"].put_dir(stores["s3"].adapter_key(f"ftjob-ad{i}"), folder / f"ad{i}")
        replica = SimpleNamespace(
            store=stores["s3_prefetched"], _prefetched=set(), _prefetching=None
        )
        LoraServer.func_or_class.prefetch(replica, [f"ftjob-ad{i}" for i in range(n)])
        replica._prefetching.join()
        prefetch_read = stores["s3_prefetched"].fetched
        read["prefetch"] = {"bytes": prefetch_read.bytes, "objects": prefetch_read.objects}
        if len(replica._prefetched) != n:
            raise ReadFromS3(f"the prefetch copied {len(replica._prefetched)} of {n} adapters")

        def locate(store: Any) -> Any:
            return lambda a: store.local_copy(store.adapter_key(f"ftjob-{a}"))

        caches = {
            name: AdapterCache(
                MultiLoraModel(load_serving_base(model_path), max_adapters=n), locate=where
            )
            for name, where in (
                ("local", lambda a: folder / a),
                ("s3", locate(stores["s3"])),
                ("s3_prefetched", locate(stores["s3_prefetched"])),
            )
        }
        for cache in caches.values():  # the first load also wraps the layers
            cache.acquire("ad0", hold=False)
        for i in range(1, n):
            for name, cache in caches.items():
                fetched = stores[name].fetched if name in stores else None
                before = (fetched.bytes, fetched.objects) if fetched else (0, 0)
                started = time.perf_counter()
                cache.acquire(f"ad{i}", hold=False)
                times[name].append(time.perf_counter() - started)
                if fetched:
                    read[name]["bytes"] += fetched.bytes - before[0]
                    read[name]["objects"] += fetched.objects - before[1]
        if read["s3_prefetched"]["bytes"] or read["s3_prefetched"]["objects"]:
            raise ReadFromS3(
                f"the prefetched adapters' cold loads read {read['s3_prefetched']} from S3: "
                "the prefetch did not reach the node cache they load from"
            )
    return times, read


def first_request_after_restart(
    model_path: Path, folder: Path, tokenizer: Any, rounds: int = 5, warm: int = 8
) -> dict[str, list[float]]:
    """A replica new on a node (an empty node cache: a scale-up, a replaced pod) gets its
    first request, for the base model's most requested adapter (one prompt, 8 greedy
    tokens, through the engine's own thread), after a start with and without warm-up:
    ``LoraServer._warm_up``, the replica's own method, loading the ``warm`` adapters of the
    serving configuration the controller stored (from S3, a real server on 127.0.0.1)
    and running one short generation before the replica takes traffic. Time from the
    request to its first and to its last token, the sides in alternation."""
    from s3 import new_bucket, s3_server
    from tunefleet.platform.artifacts import open_store
    from tunefleet.workers.serve.app import LoraServer

    prompt = make_prompts(tokenizer, 1)[0]
    busiest = [f"ftjob-ad{i}" for i in range(warm)]
    times: dict[str, list[float]] = {"warmed": [], "not_warmed": []}
    first_token: dict[str, list[float]] = {"warmed": [], "not_warmed": []}
    with s3_server() as endpoint, tempfile.TemporaryDirectory() as tmp:
        bucket = new_bucket(endpoint)
        admin = open_store(bucket, endpoint_url=endpoint, cache_dir=Path(tmp) / "admin")
        for adapter_id in busiest:
            admin.put_dir(admin.adapter_key(adapter_id), folder / adapter_id.removeprefix("ftjob-"))
        stored = json.dumps({"warm": busiest}).encode()
        admin.write_bytes(admin.serving_key(BUILTIN_MODEL), stored)
        server = LoraServer.func_or_class
        for r in range(rounds):
            for side in times:
                node = open_store(bucket, endpoint_url=endpoint, cache_dir=Path(tmp) / f"{side}{r}")
                lora = MultiLoraModel(load_serving_base(model_path), max_adapters=warm)
                engine = BatchEngine(lora, set(), max_batch_size=4)
                engine.start()  # its own thread, as the replica runs it
                replica = SimpleNamespace(
                    store=node,
                    base_model=BUILTIN_MODEL,
                    cache=AdapterCache(
                        lora, locate=lambda a, node=node: node.local_copy(node.adapter_key(a))
                    ),
                    engine=engine,
                    tokenizer=tokenizer,
                    pad_id=0,
                    apply_config=lambda wanted: None,
                    prefetch=lambda adapter_ids: None,
                )
                replica._warm_compute = lambda slot, replica=replica: server._warm_compute(
                    replica, slot
                )
                if side == "warmed":
                    warmed = server._warm_up(replica)
                    if warmed != busiest:
                        raise RuntimeError(f"the replica warmed {warmed}, not {busiest}")
                ended = threading.Event()
                tokens: list[tuple[int, float]] = []  # (token, when)

                def sink(
                    token: int | None, finish: Any, tokens: Any = tokens, ended: Any = ended
                ) -> None:
                    if token is not None:
                        tokens.append((token, time.perf_counter()))
                    if finish is not None:
                        ended.set()

                started = time.perf_counter()
                slot = replica.cache.acquire(busiest[0], hold=False)
                engine.submit(prompt, Sampling(8, 0), slot, sink)
                ended.wait(300)
                times[side].append(time.perf_counter() - started)
                first_token[side].append(tokens[0][1] - started)
                engine.stop()
                assert len(tokens) == 8, tokens
                del engine, lora, replica
                gc.collect()
    return {
        **{f"{side}_last_token": t for side, t in times.items()},
        **{f"{side}_first_token": t for side, t in first_token.items()},
    }


def restart_figures(after_restart: dict[str, list[float]]) -> dict[str, float]:
    """Medians of a new replica's first request, to its first and its last token."""
    figures = {}
    for until in ("first_token", "last_token"):
        warmed = statistics.median(after_restart[f"warmed_{until}"])
        cold = statistics.median(after_restart[f"not_warmed_{until}"])
        figures |= {
            f"restart_{until}_warmed_median_ms": round(warmed * 1000, 3),
            f"restart_{until}_not_warmed_median_ms": round(cold * 1000, 3),
            f"restart_{until}_warmed_vs_not": round(warmed / cold, 3),
        }
    return figures


def write_cold_loads(
    loads: list[float],
    by_store: dict[str, list[float]],
    read: dict[str, dict[str, int]],
    after_restart: dict[str, list[float]],
) -> None:
    result = {
        "model": BUILTIN_MODEL,
        "machine": machine.describe(),
        "rank": 16,
        "adapters": len(by_store["s3"]),
        "cold_load_median_ms": round(statistics.median(loads) * 1000, 3),
        **cold_load_figures(by_store),
        "read_from_s3_during_loads": read,
        **restart_figures(after_restart),
    }
    result["targets_met"] = cold_load_targets(result)
    out = ROOT / "bench" / "results" / "serve_multilora_cold_load.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


def cold_load_figures(by_store: dict[str, list[float]]) -> dict[str, float]:
    local = statistics.median(by_store["local"])
    figures = {"cold_load_wall_local_median_ms": round(local * 1000, 3)}
    for name in ("s3", "s3_prefetched"):
        median = statistics.median(by_store[name])
        figures[f"cold_load_wall_{name}_median_ms"] = round(median * 1000, 3)
        figures[f"cold_load_{name}_vs_local"] = round(median / local, 3)
    return figures


def cold_load_targets(figures: dict[str, Any]) -> dict[str, bool]:
    return {
        "cold load from S3 at most 1.2x local (prefetched to the node)": figures[
            "cold_load_s3_prefetched_vs_local"
        ]
        <= 1.2,
        "cold load from S3 at most 2x local (on request, no prefetch)": figures[
            "cold_load_s3_vs_local"
        ]
        <= 2,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--adapters", default="1,8,32,128")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--sample", type=int, default=16, help="requests timed for (a)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--mixed-ranks-only",
        action="store_true",
        help="only the mixed-rank stream: serve_multilora_mixed_ranks.json",
    )
    parser.add_argument(
        "--cold-load-only",
        action="store_true",
        help="only the cold loads (local store and S3): serve_multilora_cold_load.json",
    )
    args = parser.parse_args()
    if args.quick:
        args.requests, args.new_tokens, args.adapters, args.repeats = 16, 4, "1,4,16", 1
        args.sample = 4
    counts = [int(c) for c in args.adapters.split(",")]
    torch.set_num_threads(max(1, torch.get_num_threads()))

    from transformers import AutoTokenizer

    model_path = prepare_builtin(ModelRegistry(get_settings().resolved_model_registry))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    prompts = make_prompts(tokenizer, args.requests)
    auto, why = serving_precision("auto")
    sides = ["fp32", *(["bf16"] if auto == "bf16" else [])]
    if args.mixed_ranks_only:
        mixed_ranks(model_path, tokenizer, prompts, args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        base = load_serving_base(model_path)
        for i in range(max(counts)):
            save_random_lora(
                base, folder / f"ad{i}", r=16, alpha=32, targets=TARGETS, seed=i, std=0.02
            )
        del base
        loads = cold_loads(model_path, folder, min(max(counts), 64))
        by_store, read = cold_loads_by_store(model_path, folder, min(max(counts), 64))
        after_restart = first_request_after_restart(model_path, folder, tokenizer)
        if args.cold_load_only:
            write_cold_loads(loads, by_store, read, after_restart)
            return
        measured = {}
        for precision in sides:
            PLACE["dtype"] = DTYPES[precision]
            SEEN.clear()
            rates, merged = throughput(model_path, folder, prompts, counts, args, tokenizer, pad)
            if {precision} != SEEN:  # what the runs' bases really held
                raise RuntimeError(f"the {precision} side ran in {sorted(SEEN)}")
            measured[precision] = (rates, merged)

    cold = {
        "cold_load_median_ms": statistics.median(loads) * 1000,
        **cold_load_figures(by_store),
        **restart_figures(after_restart),
    }
    result: dict[str, Any] = {
        "model": BUILTIN_MODEL,
        "machine": machine.describe(),
        "auto_precision": {"chosen": auto, "why": why},
        "requests": args.requests,
        "new_tokens": args.new_tokens,
        "rank": 16,
        "target_modules": list(TARGETS),
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "sides": {p: side(*measured[p], counts) for p in sides},
        "cold_load": {k: round(v, 4) for k, v in cold.items()},
        "cold_load_read_from_s3": read,
        "cold_load_targets_met": {
            "median cold load < 50 ms (r=16)": cold["cold_load_median_ms"] < 50,
            **cold_load_targets(cold),
        },
    }
    if "bf16" in measured:
        result["tunefleet_bf16_vs_fp32"] = {
            str(n): round(
                measured["bf16"][0]["tunefleet"][n] / measured["fp32"][0]["tunefleet"][n], 3
            )
            for n in counts
        }
    out = (
        ROOT
        / "bench"
        / "results"
        / ("serve_multilora_quick.json" if args.quick else "serve_multilora.json")
    )
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out.with_suffix(".png"), counts)
    print(json.dumps(result, indent=2))


def throughput(
    model_path: Path,
    folder: Path,
    prompts: list[list[int]],
    counts: list[int],
    args: argparse.Namespace,
    tokenizer: Any,
    pad: int,
) -> tuple[dict[str, dict[int, float]], float]:
    """Every configuration ``args.repeats`` times in alternation, the best rate of each, in
    the precision ``PLACE`` says."""
    rates: dict[str, dict[int, float]] = {
        "tunefleet": {},
        "peft_set_adapter": {},
        "peft_mixed_batch": {},
    }
    merged = 0.0
    label = str(PLACE["dtype"]).removeprefix("torch.")
    for rep in range(args.repeats):
        merged = max(merged, run_merged(model_path, folder, prompts, args.new_tokens, tokenizer))
        print(f"[{label} {rep}] merged: {merged:.1f} tok/s", flush=True)
        for n in counts:
            tf = run_tunefleet(model_path, folder, prompts, n, args.new_tokens, tokenizer)
            rates["tunefleet"][n] = max(rates["tunefleet"].get(n, 0), tf)
            gc.collect()
            peft = _peft_with(model_path, folder, n)
            a = run_peft_set_adapter(peft, prompts, n, args.new_tokens, pad, args.sample)
            b = run_peft_mixed(peft, prompts, n, args.new_tokens, pad)
            del peft
            gc.collect()
            rates["peft_set_adapter"][n] = max(rates["peft_set_adapter"].get(n, 0), a)
            rates["peft_mixed_batch"][n] = max(rates["peft_mixed_batch"].get(n, 0), b)
            print(
                f"[{label} {rep}] {n:>3} adapters: tunefleet {tf:.1f}, "
                f"peft set_adapter {a:.1f}, peft mixed {b:.1f} tok/s",
                flush=True,
            )
    return rates, merged


def side(rates: dict[str, dict[int, float]], merged: float, counts: list[int]) -> dict[str, Any]:
    """One precision's rates, figures and targets."""
    tf = rates["tunefleet"]
    mid = 32 if 32 in tf else counts[len(counts) // 2]
    top = max(counts)
    figures = {
        f"vs_set_adapter_at_{mid}": tf[mid] / rates["peft_set_adapter"][mid],
        f"vs_mixed_batch_at_{mid}": tf[mid] / rates["peft_mixed_batch"][mid],
        f"loss_at_{top}_vs_1": 1 - tf[top] / tf[1],
        "single_adapter_overhead_vs_merged": 1 - tf[1] / merged,
    }
    checks = {
        f"at {mid} adapters >= 10x peft set_adapter": figures[f"vs_set_adapter_at_{mid}"] >= 10,
        f"at {mid} adapters >= 2x peft mixed batch": figures[f"vs_mixed_batch_at_{mid}"] >= 2,
        f"{top} adapters within 20% of 1": figures[f"loss_at_{top}_vs_1"] <= 0.20,
        "single adapter within 25% of merged": figures["single_adapter_overhead_vs_merged"] <= 0.25,
    }
    return {
        "tokens_per_s": {k: {str(n): round(v, 2) for n, v in d.items()} for k, d in rates.items()}
        | {"merged": round(merged, 2)},
        "figures": {k: round(v, 4) for k, v in figures.items()},
        "targets_met": checks,
    }


def plot(result: dict[str, Any], path: Path, counts: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    precision = result["auto_precision"]["chosen"]
    rates = result["sides"][precision]["tokens_per_s"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    labels = {
        "tunefleet": "TuneFleet batched",
        "peft_mixed_batch": "peft adapter_names batch",
        "peft_set_adapter": "peft set_adapter per request",
    }
    for key, label in labels.items():
        ys = [rates[key][str(n)] for n in counts]
        ax.plot(counts, ys, marker="o", label=label)
    ax.axhline(
        rates["merged"],
        linestyle="--",
        color="grey",
        label="merged single adapter",
    )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("distinct adapters in the batch")
    ax.set_ylabel("generated tokens/s")
    ax.set_title(f"{result['model']}, {result['requests']} requests, CPU, {precision}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


MIXED_RANKS = (8, 16, 64, 128)
MIXED_BUDGET = 2 << 30


def run_stream(
    model_path: Path,
    folder: Path,
    names: list[str],
    prompts: list[list[int]],
    new: int,
    tokenizer: Any,
    budget: int | None,
) -> dict[str, Any]:
    """The stream (request i on adapter ``names[i % len(names)]``) in one continuous
    batch under ``budget``: tokens/s and the adapter memory the replica held."""
    lora = MultiLoraModel(serving_base(model_path), max_adapters=len(names), budget_bytes=budget)
    evicted: list[str] = []
    cache = AdapterCache(lora, locate=lambda a: folder / a, on_evict=evicted.append)
    engine = BatchEngine(lora, set(), max_batch_size=len(prompts))
    slots = [cache.acquire(names[i % len(names)]) for i in range(len(prompts))]  # held
    sampling = Sampling(max_tokens=new, temperature=0)
    generate_all(engine, tokenizer, [(prompts[0], Sampling(2, 0), slots[0])])  # warm-up
    started = time.perf_counter()
    done = generate_all(
        engine, tokenizer, [(p, sampling, s) for p, s in zip(prompts, slots, strict=True)]
    )
    elapsed = time.perf_counter() - started
    assert all(d.completion_tokens == new for d in done)
    memory = cache.memory()
    assert budget is None or memory["allocated_bytes"] <= budget, memory  # type: ignore[operator]
    return {
        "tokens_per_s": len(prompts) * new / elapsed,
        "buckets": dict(sorted(lora.depth.items())),
        "used_bytes": memory["used_bytes"],
        "allocated_bytes": memory["allocated_bytes"],
        "evicted": len(evicted),
    }


def mixed_ranks(
    model_path: Path, tokenizer: Any, prompts: list[list[int]], args: argparse.Namespace
) -> None:
    """Issue 40's acceptance: mixed ranks in one stream against all at rank 16."""
    n = 64
    ranks = [MIXED_RANKS[i % len(MIXED_RANKS)] for i in range(n)]
    random.Random(0).shuffle(ranks)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        base = load_serving_base(model_path)
        for i, r in enumerate(ranks):
            save_random_lora(base, folder / f"mx{i}", r=r, alpha=2 * r, targets=TARGETS, seed=i,
                             std=0.02)  # fmt: skip
            save_random_lora(base, folder / f"u{i}", r=16, alpha=32, targets=TARGETS, seed=i,
                             std=0.02)  # fmt: skip
        # what 64 adapters of rank 128 would take: each its rank times the targets' sizes
        width = sum(
            m.in_features + m.out_features
            for name, m in base.named_modules()
            if name.rpartition(".")[2] in TARGETS
        )
        del base
        per_unit = width * _multilora.FACTOR_BYTES
        mixed = [f"mx{i}" for i in range(n)]
        uniform = [f"u{i}" for i in range(n)]
        runs: dict[str, list[dict[str, Any]]] = {"uniform_16": [], "mixed": [], "padded_128": []}
        bucket_of = _multilora.bucket_of
        for rep in range(args.repeats):
            for case in runs:
                gc.collect()
                if case == "padded_128":  # every adapter in the rank-128 stack
                    _multilora.bucket_of = lambda r: 128  # type: ignore[assignment]
                try:
                    names, budget = {
                        "uniform_16": (uniform, MIXED_BUDGET),
                        "mixed": (mixed, MIXED_BUDGET),
                        "padded_128": (mixed, None),
                    }[case]
                    run = run_stream(
                        model_path, folder, names, prompts, args.new_tokens, tokenizer, budget
                    )
                finally:
                    _multilora.bucket_of = bucket_of
                runs[case].append(run)
                print(f"[{rep}] {case}: {run['tokens_per_s']:.1f} tok/s, "
                      f"{run['allocated_bytes'] / 2**20:.0f} MiB held", flush=True)  # fmt: skip
    best = {case: max(rs, key=lambda r: r["tokens_per_s"]) for case, rs in runs.items()}
    rate = {case: r["tokens_per_s"] for case, r in best.items()}
    uniform_128 = n * 128 * per_unit
    figures = {
        "mixed_vs_uniform_16": round(rate["mixed"] / rate["uniform_16"], 4),
        "mixed_vs_padded_128": round(rate["mixed"] / rate["padded_128"], 4),
        "padding_cost": round(1 - rate["padded_128"] / rate["mixed"], 4),
        "uniform_128_bytes": uniform_128,
        "uniform_128_vs_budget": round(uniform_128 / MIXED_BUDGET, 3),
        "mixed_allocated_vs_padded": round(
            best["mixed"]["allocated_bytes"] / best["padded_128"]["allocated_bytes"], 4
        ),
    }
    result = {
        "model": BUILTIN_MODEL,
        "machine": machine.describe(),
        "requests": len(prompts),
        "new_tokens": args.new_tokens,
        "adapters": n,
        "ranks": {str(r): ranks.count(r) for r in MIXED_RANKS},
        "target_modules": list(TARGETS),
        "budget_bytes": MIXED_BUDGET,
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "tokens_per_s": {case: round(r, 2) for case, r in rate.items()},
        "runs": {case: [round(r["tokens_per_s"], 2) for r in rs] for case, rs in runs.items()},
        "memory": {
            case: {k: best[case][k] for k in ("buckets", "used_bytes", "allocated_bytes")}
            for case in best
        },
        "evicted": {case: best[case]["evicted"] for case in best},
        "figures": figures,
        "targets_met": {
            "mixed ranks within 15% of all rank 16": figures["mixed_vs_uniform_16"] >= 0.85,
            "uniform rank 128 would overflow the budget": uniform_128 > MIXED_BUDGET,
            "mixed ranks held within the budget, none evicted": best["mixed"]["allocated_bytes"]
            <= MIXED_BUDGET
            and best["mixed"]["evicted"] == 0,
        },
    }
    out = ROOT / "bench" / "results" / "serve_multilora_mixed_ranks.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
