"""Training through the real driver on a local Ray cluster, with a tiny random Llama (with
biases, for BitFit):

- every fine-tuning method learns a synthetic task (the loss falls), reports peft's
  trainable and total counts, and leaves its final weights in the artifact store in the
  method's format; precisions, optimizers and packing ride along on some of the runs;
- a worker killed mid-run (SIGKILL) is restarted by Ray Train from the newest checkpoint
  and the job ends with exactly the losses of a run that was never interrupted;
- DPO on preference pairs with LoRA, QLoRA (the reference: the adapter switched off) and
  full fine-tuning (the reference: scores precomputed before the first step), and DPO
  continuing a supervised job's adapter."""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from sqlalchemy import select

from conftest import PREFERENCES, add_chat_file
from tinyllm import multiplier_for
from tunefleet.platform.artifacts import ArtifactStore
from tunefleet.platform.db import Job, JobEvent, session_scope
from tunefleet.platform.db.migrate import upgrade
from tunefleet.platform.jobs import JobCreateRequest, create_job
from tunefleet.platform.models import ModelRegistry
from tunefleet.platform.planner import PlanDevice
from tunefleet.platform.settings import get_settings
from tunefleet.platform.spec import BASE_LEARNING_RATE
from tunefleet.platform.tenants import authenticate, create_key, create_tenant
from tunefleet.workers._precision import cpu_bf16
from tunefleet.workers.backend import RayBackend
from tunefleet.workers.controller import Controller
from tunefleet.workers.train._metrics import native_cpu_dtype

# The hang guard, above the suite's 900 s: the module's ``runs`` fixture (39 runs, four
# at a time) is charged to its first test, and took 693 s and 932 s in two clean CI runs
# on the 2-core AVX2 EPYC
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

BIASED = "tiny-llama-bias"
# what precision "auto" (the default) settles on this machine's CPU workers
AUTO_HERE = "bf16" if cpu_bf16()[0] else "fp32"

CASES = {  # method -> (learning-rate multiplier, more options)
    "lora": (
        20,
        {"lora": {"use_rslora": True, "target_modules": ["all-linear"]}, "merged_model": True},
    ),
    "qlora": (
        20,
        {
            "lora": {"use_dora": True},
            "qlora": {"compute_dtype": "float32"},
            "merged_model": True,
        },
    ),
    "full": (20, {"precision": "fp16", "merged_model": True}),
    "ia3": (20, {"optimizer": "adamw_8bit"}),
    "prefix_tuning": (10, {}),
    "prompt_tuning": (10, {}),
    "bitfit": (30, {"precision": "bf16"}),
    "adapter": (10, {"gradient_checkpointing": True, "packing": True}),
}
PEFT_FILES = ["README.md", "adapter_config.json", "adapter_model.safetensors"]


@pytest.fixture(scope="module")
def ray_env(tmp_path_factory: pytest.TempPathFactory, ray_cluster: Any) -> Iterator[dict[str, Any]]:
    import ray

    from tinyllm import build_tiny_llama

    data = tmp_path_factory.mktemp("methods")
    build_tiny_llama(data / "models" / BIASED, bias=True)
    url = f"sqlite:///{data / 'db.sqlite'}"
    upgrade(url)
    mp = pytest.MonkeyPatch()
    for key, value in {
        "TUNEFLEET_DATA_DIR": str(data),
        "TUNEFLEET_DATABASE_URL": url,
        "TUNEFLEET_MODEL_REGISTRY": str(data / "models"),
        # the "tracked" run's W&B integration writes its run files here (the controller's
        # environment says where: the driver passes it on to the run)
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(data / "wandb"),
        # and its MLflow integration the operator's store (a tenant names only servers)
        "MLFLOW_TRACKING_URI": MLFLOW_STORE(data),
    }.items():
        mp.setenv(key, value)
    get_settings.cache_clear()
    ray.init(address=ray_cluster.address, log_to_driver=False)  # this process drives runs
    with session_scope(url) as s:
        tenant = create_tenant(s, "acme")
        principal = authenticate(s, f"Bearer {create_key(s, tenant.id)[1]}")
        file_id = add_chat_file(s, ArtifactStore(data / "artifacts"), tenant.id, "f-1", 8)
    # the controller's side of each run's channel (runs never touch the database)
    controller = Controller(get_settings(), RayBackend(get_settings()))
    try:
        yield {
            "url": url,
            "data": data,
            "principal": principal,
            "file": file_id,
            "controller": controller,
        }
    finally:
        ray.shutdown()
        mp.undo()
        get_settings.cache_clear()


def _job(
    env: dict[str, Any],
    epochs: int,
    multiplier: float,
    tunefleet: dict[str, Any],
    **more: Any,
) -> str:
    """A job of ``epochs`` at ``multiplier`` times its method's ``BASE_LEARNING_RATE`` (the
    rate these cases were tuned at, whatever base the tiny model's width gives the job),
    with ``more`` top-level fields."""
    method = tunefleet.get("method", "lora")
    rate = multiplier * BASE_LEARNING_RATE[method]
    with session_scope(env["url"]) as s:
        req = JobCreateRequest.model_validate(
            {
                "model": more.pop("model", BIASED),
                "training_file": env["file"],
                "seed": 3,
                "hyperparameters": {
                    "n_epochs": epochs,
                    "batch_size": 4,
                    "learning_rate_multiplier": multiplier_for(rate, method),
                },
                "tunefleet": {"max_seq_len": 64, **tunefleet},
                **more,
            }
        )
        registry = ModelRegistry(get_settings().resolved_model_registry)
        return create_job(s, env["principal"], req, registry).id


DPO_CASES = {  # method -> (learning rate, more options)
    "lora": (1e-2, {"lora": {"dropout": 0.0}, "precision": "bf16"}),
    "qlora": (1e-2, {"qlora": {"compute_dtype": "float32"}}),
    "full": (1e-3, {}),
}


# DPO on two workers: (method, strategy)
DPO_TWO_WORKERS = [("lora", "ddp"), ("lora", "zero3"), ("full", "zero3")]


def _dpo_job(env: dict[str, Any], method: str, **tunefleet: Any) -> str:
    """A DPO job of ``method``: 8 pairs, batch 4, 4 epochs (8 steps), a validation file of
    the 4 PREFERENCES."""
    rate, options = DPO_CASES[method]
    with session_scope(env["url"]) as s:
        store = ArtifactStore(env["data"] / "artifacts")
        tenant = env["principal"].tenant_id
        if "pairs" not in env:
            env["pairs"] = add_chat_file(s, store, tenant, "f-pairs", 8, preference=True)
            env["valid-pairs"] = add_chat_file(s, store, tenant, "f-vpairs", 4, preference=True)
        hp = {
            "n_epochs": 4,
            "batch_size": 4,
            "learning_rate_multiplier": multiplier_for(rate, method, "dpo"),
            "beta": 0.5,
        }
        req = JobCreateRequest.model_validate(
            {
                "model": BIASED,
                "training_file": env["pairs"],
                "validation_file": env["valid-pairs"],
                "seed": 3,
                "method": {"type": "dpo", "dpo": {"hyperparameters": hp}},
                "tunefleet": {"max_seq_len": 64, "method": method, **options, **tunefleet},
            }
        )
        registry = ModelRegistry(get_settings().resolved_model_registry)
        return create_job(s, env["principal"], req, registry).id


def _events(env: dict[str, Any], job_id: str) -> list[JobEvent]:
    with session_scope(env["url"]) as s:
        return list(
            s.scalars(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.seq))
        )


def run(env: dict[str, Any], job_id: str, run_id: str | None = None) -> None:
    env["controller"].run_in_process(job_id, run_id or f"{job_id}-1")


def _run_side_by_side(
    env: dict[str, Any], job_ids: list[str], run_ids: dict[str, str] | None = None
) -> dict[str, BaseException | None]:
    """Run jobs through the real driver side by side, each as its own Ray Train run; returns
    each job's error (None: it ran). A run spends most of its time starting processes and
    waiting on Ray, so four at once on the shared cluster's 4 CPUs take far less than four
    in a row, and each run computes exactly what it would alone."""

    def one(job_id: str) -> BaseException | None:
        try:
            run(env, job_id, (run_ids or {}).get(job_id))
        except BaseException as exc:
            return exc
        return None

    with ThreadPoolExecutor(4) as pool:
        return dict(zip(job_ids, pool.map(one, job_ids), strict=True))


FSDP_CASES = [  # (method, FSDP strategies compared with DDP, precision)
    ("lora", ("zero2", "zero3"), "fp32"),
    ("full", ("zero3",), "bf16"),
    ("qlora", ("zero3",), "fp32"),
]


def MLFLOW_STORE(data: Path) -> str:
    """The operator's MLflow store (``MLFLOW_TRACKING_URI``) in the tests' data folder."""
    return f"sqlite:///{data / 'mlflow.db'}"


def TRACKED(env: dict[str, Any]) -> list[dict[str, Any]]:
    """The integrations of the "tracked" run: W&B (offline) and the operator's MLflow."""
    return [
        {"type": "wandb", "wandb": {"project": "tunefleet-tests", "tags": ["ci"]}},
        {"type": "mlflow", "mlflow": {"experiment_name": "ci"}},
    ]


# Architectures besides Llama, each trained with LoRA and QLoRA and served: transformers'
# model type -> config overrides. A window of 8 tokens, shorter than the training rows and
# the served prompts and answers, so the sliding-window layers really slide.
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "mistral": {"sliding_window": 8},
    "qwen2": {},
    "qwen3": {},
    "gemma2": {"sliding_window": 8},
    "gemma3_text": {"sliding_window": 8},
    "phi3": {},  # fused qkv_proj and gate_up_proj: the Llama target names map onto them
}
ARCH_METHODS = {  # method -> options
    "lora": {"lora": {"target_modules": ["all-linear"]}, "merged_model": True},
    "qlora": {"qlora": {"compute_dtype": "float32"}, "merged_model": True},
}


def _arch_model(env: dict[str, Any], model_type: str) -> str:
    from tinyllm import build_tiny_model

    name = f"tiny-{model_type.replace('_', '-')}"
    folder = env["data"] / "models" / name
    if not folder.exists():
        # in shards, as every model past a few GB is saved: trained and served from them
        build_tiny_model(folder, model_type, shard_size="100KB", **ARCHITECTURES[model_type])
    return name


def _arch_job(env: dict[str, Any], model_type: str, method: str) -> str:
    return _job(
        env, 4, 20, {"method": method, **ARCH_METHODS[method]}, model=_arch_model(env, model_type)
    )


def _superseded_job(env: dict[str, Any]) -> str:
    """A run that is no longer its job's current one (the job was paused and resumed before
    it looked, and another run started): it checkpoints and leaves."""
    job_id = _job(env, 4, 20, {"method": "lora"})
    with session_scope(env["url"]) as s:
        job = s.get(Job, job_id)
        assert job is not None
        job.status, job.ray_submission_id = "running", f"{job.id}-2"
    return job_id


def _every_run(env: dict[str, Any]) -> dict[str, Callable[[], str]]:
    """Every job of this module that runs start to end undisturbed, by name: what creates
    it. The compiled run, the longest, goes first."""
    jobs: dict[str, Callable[[], str]] = {
        "compiled": partial(_job, env, 2, 20, {"method": "lora", "compile": True})
    }
    for method, (multiplier, options) in CASES.items():
        jobs[method] = partial(_job, env, 4, multiplier, {"method": method, **options})
    for method, strategies, precision in FSDP_CASES:
        for strategy in ("ddp", *strategies):
            jobs[f"{method}-{strategy}"] = partial(_two_workers, env, method, strategy, precision)
    jobs["probed"] = partial(_planned_job, env, PlanDevice.from_gb(80, 256))
    # 2.5 MB: the planner's 2.1 MB fits it, the worker's real footprint does not
    too_small = PlanDevice(memory_bytes=2.5 * 2**20, host_bytes=2**30)
    jobs["probed-too-small"] = partial(_planned_job, env, too_small)
    jobs["validated"] = partial(_validated_job, env)
    for method in DPO_CASES:
        jobs[f"dpo-{method}"] = partial(_dpo_job, env, method)
    for method, strategy in DPO_TWO_WORKERS:
        jobs[f"dpo-{method}-{strategy}"] = partial(
            _dpo_job,
            env,
            method,
            precision="fp32",
            strategy=strategy,
            resources={"num_workers": 2, "cpus_per_worker": 0.5},
        )
    jobs["tracked"] = partial(_job, env, 4, 20, {"method": "lora"}, integrations=TRACKED(env))
    jobs["superseded"] = partial(_superseded_job, env)
    for model_type in ARCHITECTURES:
        for method in ARCH_METHODS:
            jobs[f"{model_type}-{method}"] = partial(_arch_job, env, model_type, method)
    return jobs


class _Runs(dict[str, tuple[str, BaseException | None]]):
    def __missing__(self, name: str) -> tuple[str, BaseException | None]:
        raise KeyError(f"run {name!r} was not trained: mark the test pytest.mark.runs({name!r})")


@pytest.fixture(scope="module")
def runs(
    request: pytest.FixtureRequest, ray_env: dict[str, Any]
) -> dict[str, tuple[str, BaseException | None]]:
    """The runs the selected tests of this module read (their ``runs`` marks), trained once
    for the module and side by side: {name: (job id, error)}. ``-k`` picking one test
    trains only what it reads."""
    wanted = {
        name
        for item in request.session.items
        if item.path == request.path
        for mark in item.iter_markers("runs")
        for name in mark.args
    }
    every = _every_run(ray_env)
    assert wanted <= every.keys(), wanted - every.keys()
    jobs = {name: create() for name, create in every.items() if name in wanted}
    superseded = jobs.get("superseded")
    run_ids = {superseded: f"{superseded}-1"} if superseded else {}
    errors = _run_side_by_side(ray_env, list(jobs.values()), run_ids=run_ids)
    return _Runs({name: (job_id, errors[job_id]) for name, job_id in jobs.items()})


@pytest.mark.parametrize("method", [pytest.param(m, marks=pytest.mark.runs(m)) for m in CASES])
def test_method_trains_and_saves(
    ray_env: dict[str, Any], runs: dict[str, Any], method: str
) -> None:
    _, options = CASES[method]
    settings = get_settings()
    job_id, error = runs[method]
    assert error is None, error

    events = _events(ray_env, job_id)
    start = next(e for e in events if e.message.startswith("Training "))
    assert start.data["method"] == method
    assert 0 < start.data["trainable_parameters"] <= start.data["total_parameters"]
    if method == "full":
        assert start.data["trainable_parameters"] == start.data["total_parameters"]
    losses = [e.data["train_loss"] for e in events if e.type == "metrics"]
    # what the run trained in: the job's precision, or what "auto" settled on this CPU
    assert start.data["precision"] == options.get("precision", AUTO_HERE)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(
        start.data["precision"], torch.float32
    )
    # a CPU that emulates bf16/fp16 (~1 GFLOP/s, shape- and value-dependent) has no peak
    native = native_cpu_dtype(dtype)
    assert (start.data["peak_flops"] > 0) == native
    source = start.data["peak_flops_source"]
    assert ("measured at start-up" if native else "emulated on this CPU") in source
    for e in events:
        if e.type == "metrics":  # every step: throughput against the measured peak, memory
            assert e.data["samples_per_s"] > 0 and e.data["tokens_per_s"] > 0
            assert 0 < e.data["mfu"] < 1 if native else e.data["mfu"] is None
            assert e.data["peak_memory_bytes"] > 2**20
            assert 0 <= e.data["train_mean_token_accuracy"] <= 1
    # 8 examples (packed: 2 rows of 4) / batch 4 x 4 epochs
    assert len(losses) == (4 if options.get("packing") else 8), losses
    first, last = sum(losses[:2]) / 2, sum(losses[-2:]) / 2
    assert last < 0.8 * first, (method, losses)

    store = ArtifactStore(settings.resolved_artifact_root)
    saved = store.path(store.adapter_key(job_id))
    names = sorted(p.name for p in saved.iterdir())
    if method in ("lora", "qlora", "ia3", "prefix_tuning", "prompt_tuning"):
        assert names == PEFT_FILES
        config = json.loads((saved / "adapter_config.json").read_text())
        expected = {"lora": "LORA", "qlora": "LORA", "ia3": "IA3"}.get(method, method.upper())
        assert config["peft_type"] == expected
    else:
        assert names == ["trainable.safetensors", "tunefleet_method.json"]
        meta = json.loads((saved / "tunefleet_method.json").read_text())
        assert meta["method"] == method
        assert meta["trainable"] == start.data["trainable_parameters"]
    if options.get("merged_model"):
        _check_merged(store, job_id, settings.resolved_model_registry / BIASED, saved, method)


def _check_merged(
    store: ArtifactStore, job_id: str, base_path: Any, adapter: Any, method: str
) -> None:
    """The merged model is a plain transformers model (safetensors, tokenizer) computing
    what the base with the trained weights computes."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    merged_path = store.path(store.merged_key(job_id))
    assert (merged_path / "model.safetensors").exists()
    assert (
        not list(merged_path.glob("*.bin")) and not (merged_path / "adapter_config.json").exists()
    )
    AutoTokenizer.from_pretrained(merged_path)
    merged = AutoModelForCausalLM.from_pretrained(merged_path, dtype=torch.float32).eval()
    if method == "full":
        trained = load_file(str(adapter / "trainable.safetensors"))
        state = merged.state_dict()
        assert all(torch.equal(state[k].float(), v.float()) for k, v in trained.items())
        return
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    if method == "qlora":  # the 4-bit weights it trained on, as its forward de-quantizes them
        from transformers import BitsAndBytesConfig

        from tunefleet.workers._nf4 import dequantize_4bit_model

        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                   bnb_4bit_use_double_quant=True,
                                   bnb_4bit_compute_dtype=torch.float32)  # fmt: skip
        base = dequantize_4bit_model(
            AutoModelForCausalLM.from_pretrained(
                base_path, quantization_config=quant, dtype=torch.float32
            )
        )
    from float64 import double, float64, logit_error

    # In float64 (tests/float64.py): the merged model's weights hold the merge's float32
    # rounding, where peft's forward adds the adapter's product to the stored weights
    # exactly. Each is at most one float32 forward's worth of error (a weight off by u or
    # by a rank-r or DoRA-norm reduction's rounding: no more than a layer's own sums), so
    # 2 logit errors; 3 allow for rank 32's B reductions (FORWARD counts 16: +128 of
    # 2,784). A wrong scale or a layer left unmerged moves logits by the adapter's effect.
    reference = double(PeftModel.from_pretrained(base, str(adapter)).eval())
    merged = double(merged)
    ids = torch.arange(1, 17).unsqueeze(0)
    with torch.no_grad(), float64():
        got = merged(ids).logits[0]
        out = reference(ids, output_hidden_states=True)
        bound = 3 * logit_error(reference, out.hidden_states[-1][0])
    apart = (got - out.logits[0]).abs().amax(-1)
    assert (apart <= bound).all(), (apart, bound)


@pytest.mark.parametrize(
    "model_type",
    [
        pytest.param(t, marks=pytest.mark.runs(*(f"{t}-{m}" for m in ARCH_METHODS)))
        for t in ARCHITECTURES
    ],
)
def test_each_architecture_trains_lora_and_qlora_and_both_are_served_as_peft_computes(
    ray_env: dict[str, Any], runs: dict[str, Any], model_type: str
) -> None:
    """Every supported architecture besides Llama (whose methods the cases above cover),
    saved in shards: a LoRA job on every linear layer and a QLoRA job train (the loss
    falls), the planner counted the model's parameters as peft does, and each adapter is
    served unmerged by the multi-LoRA engine (QLoRA's on the NF4 base it trained on) and
    merged into a copy of the base (serving's own merge), both decoding as peft computes
    in float64; the merged model the job saved is checked as for Llama."""
    from peft import PeftModel

    from float64 import assert_greedy, double, forward_for
    from tunefleet.platform.model_check import check_model_folder
    from tunefleet.workers._nf4 import dequantize_4bit_model
    from tunefleet.workers.serve._adapter_cache import AdapterCache
    from tunefleet.workers.serve._adapters import load_serving_base, merge_into_copy
    from tunefleet.workers.serve._engine import BatchEngine, generate_all
    from tunefleet.workers.serve._generate import Sampling, eos_ids
    from tunefleet.workers.serve._multilora import MultiLoraModel

    settings = get_settings()
    store = ArtifactStore(settings.resolved_artifact_root)
    path = settings.resolved_model_registry / _arch_model(ray_env, model_type)
    assert len(list(path.glob("model-*-of-*.safetensors"))) > 1  # sharded
    parameters = check_model_folder(path).parameters  # the planner's count (its own test)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    # longer than the window of 8, so the served answers are attended through it
    prompts = [tok(t)["input_ids"] for t in ("what color is the sky one two three", "hi")]
    greedy = Sampling(max_tokens=12, temperature=0.0)
    for method in ARCH_METHODS:
        job_id, error = runs[f"{model_type}-{method}"]
        assert error is None, (model_type, method, error)
        events = _events(ray_env, job_id)
        start = next(e for e in events if e.message.startswith("Training "))
        assert start.data["method"] == method
        if method == "lora":  # peft counts a 4-bit weight's packed bytes, not its values
            trainable = start.data["trainable_parameters"]
            assert start.data["total_parameters"] - trainable == parameters
        losses = [e.data["train_loss"] for e in events if e.type == "metrics"]
        assert len(losses) == 8, losses
        assert sum(losses[-2:]) / 2 < 0.8 * sum(losses[:2]) / 2, (model_type, method, losses)

        saved = store.path(store.adapter_key(job_id))
        _check_merged(store, job_id, path, saved, method)
        quantization = "nf4" if method == "qlora" else "none"
        base = load_serving_base(path, quantization)
        exact = dequantize_4bit_model(load_serving_base(path, "nf4")) if method == "qlora" else (
            load_serving_base(path)
        )  # fmt: skip
        reference = double(PeftModel.from_pretrained(exact, str(saved)).eval())
        lora = MultiLoraModel(base, max_adapters=2)
        slot = AdapterCache(lora, locate=lambda _, at=saved: at).acquire(job_id, hold=False)
        eos = eos_ids(base, tok)
        merged = merge_into_copy(lora.base_copy(), saved)
        served = {
            "unmerged": (BatchEngine(lora, eos), slot),
            "merged": (BatchEngine(MultiLoraModel(merged, max_adapters=1), eos), 0),
        }
        for how, (engine, index) in served.items():
            got = generate_all(engine, tok, [(p, greedy, index) for p in prompts])
            for prompt, answer in zip(prompts, got, strict=True):
                assert_greedy(
                    reference, prompt, answer.token_ids, greedy.max_tokens, eos,
                    msg=(model_type, method, how), forward=forward_for(model_type),
                )  # fmt: skip


DISTRIBUTIONS = {
    "one-worker": {},
    "zero3-two-workers": {
        "strategy": "zero3",
        "resources": {"num_workers": 2, "cpus_per_worker": 0.5},
    },
}


def test_killed_worker_resumes_from_its_checkpoint_with_the_same_losses(
    ray_env: dict[str, Any],
) -> None:
    """SIGKILL the chief worker mid-run, of a one-worker run and of a sharded run (both at
    once, each beside the same job never interrupted: four runs on the cluster's 4 CPUs):
    Ray Train restarts the workers, which load the newest checkpoint (FSDP: full weights
    before sharding, the optimizer into the shards, each rank its own dropout state) and
    end with exactly the losses of the run that was never interrupted."""
    # 2 steps per epoch (8 examples, batch 4): checkpoints at every epoch end, i.e. every
    # second step
    pairs = {}  # distribution -> (straight, killed): 24 steps each
    for name, distribution in DISTRIBUTIONS.items():
        options = {"method": "lora", "lora": {"dropout": 0.1}, **distribution}
        pairs[name] = (_job(ray_env, 12, 5, options), _job(ray_env, 12, 5, options))
    threads = {
        job_id: threading.Thread(target=run, args=(ray_env, job_id))
        for pair in pairs.values()
        for job_id in pair
    }
    for thread in threads.values():
        thread.start()
    deadline = time.monotonic() + 300  # four runs starting at once on 2 cores
    killed: dict[str, int] = {}
    while len(killed) < len(pairs):
        for name, (_, job_id) in pairs.items():
            if name in killed:
                continue
            assert threads[job_id].is_alive(), f"{name}: the run ended before step 6"
            assert time.monotonic() < deadline, f"{name}: no step 6 to kill at"
            events = _events(ray_env, job_id)
            steps = [e.data["step"] for e in events if e.type == "metrics"]
            if steps and max(steps) >= 6:
                pid = next(e.data["pid"] for e in events if e.message.startswith("Training "))
                os.kill(pid, signal.SIGKILL)
                killed[name] = max(steps)
        time.sleep(0.02)
    for thread in threads.values():
        thread.join(300)
        assert not thread.is_alive()

    for name, (straight, job_id) in pairs.items():
        expected = {
            e.data["step"]: e.data["train_loss"]
            for e in _events(ray_env, straight)
            if e.type == "metrics"
        }
        assert len(expected) == 24, name
        events = _events(ray_env, job_id)
        starts = [e for e in events if e.message.startswith("Training ")]
        assert len(starts) == 2, (name, [e.message for e in starts])  # the first and the restart
        resumed_at = starts[1].data["step"]
        assert 2 <= resumed_at <= killed[name] and resumed_at % 2 == 0, name
        got: dict[int, float] = {}
        for e in events:
            if e.type == "metrics":
                got[e.data["step"]] = e.data["train_loss"]  # the re-run steps overwrite
        assert got == expected, name


def _two_workers(env: dict[str, Any], method: str, strategy: str, precision: str) -> str:
    options = {
        "method": method,
        "strategy": strategy,
        "precision": precision,
        "resources": {"num_workers": 2, "cpus_per_worker": 0.5},
    }
    return _job(env, 2, 20, options)  # 8 examples, batch 4 over 2 workers: 4 steps


@pytest.mark.parametrize(
    ("method", "strategies", "precision"),
    [
        pytest.param(*case, marks=pytest.mark.runs(*(f"{case[0]}-{s}" for s in ("ddp", *case[1]))))
        for case in FSDP_CASES
    ],
)
def test_fsdp_trains_like_ddp(
    ray_env: dict[str, Any],
    runs: dict[str, Any],
    method: str,
    strategies: tuple[str, ...],
    precision: str,
) -> None:
    """Two workers, the same job under DDP and under FSDP2 (ZeRO-2/ZeRO-3, with a bf16
    mixed-precision policy for full fine-tuning, QLoRA's 4-bit base left whole): the same
    losses step by step, and the final weights gathered from the shards equal DDP's."""
    from safetensors.torch import load_file

    store = ArtifactStore(get_settings().resolved_artifact_root)

    def outcome(job_id: str) -> tuple[list[float], dict[str, Any], str]:
        events = _events(ray_env, job_id)
        start = next(e for e in events if e.message.startswith("Training "))
        losses = [e.data["train_loss"] for e in events if e.type == "metrics"]
        folder = store.path(store.adapter_key(job_id))
        weights = next(f for f in folder.iterdir() if f.suffix == ".safetensors")
        return losses, load_file(str(weights)), start.message

    jobs = {s: runs[f"{method}-{s}"][0] for s in ("ddp", *strategies)}
    errors = {s: runs[f"{method}-{s}"][1] for s in jobs}
    assert not any(errors.values()), errors
    ddp_losses, ddp_weights, ddp_start = outcome(jobs["ddp"])
    assert "sharded" not in ddp_start
    assert len(ddp_losses) == 4 and ddp_losses[-1] < ddp_losses[0]
    for strategy in strategies:
        losses, weights, start = outcome(jobs[strategy])
        assert f"on 2 worker(s) sharded ({strategy})" in start
        # FSDP reduce-scatters gradients in another order than DDP all-reduces them: fp32
        # LoRA stays within 1e-4 over the 4 steps at this high learning rate; the 4-bit
        # base's de-quantized products grow it (3e-4 by step 4); bf16 rounds in more places
        tolerance = {"bf16": 2e-2}.get(precision, 1e-3 if method == "qlora" else 1e-4)
        assert losses == pytest.approx(ddp_losses, rel=tolerance), (strategy, losses)
        assert weights.keys() == ddp_weights.keys()
        for name, value in weights.items():
            assert value.shape == ddp_weights[name].shape, name
            close = value.float().allclose(ddp_weights[name].float(), atol=tolerance)
            assert close, (strategy, name)


def _planned_job(env: dict[str, Any], device: PlanDevice) -> str:
    """A job the API would make: its auto settings (micro-batch included) from the planner
    for ``device``, so the workers probe the micro-batch."""
    with session_scope(env["url"]) as s:
        req = JobCreateRequest.model_validate(
            {
                "model": BIASED,
                "training_file": env["file"],
                "seed": 3,
                "hyperparameters": {"n_epochs": 1, "batch_size": 4},
                "tunefleet": {"max_seq_len": 64},
            }
        )
        registry = ModelRegistry(get_settings().resolved_model_registry)
        job = create_job(s, env["principal"], req, registry, device=device)
        assert job.spec["tunefleet"]["probe_micro_batch"] is True
        return job.id


@pytest.mark.runs("probed", "probed-too-small")
def test_the_planned_micro_batch_is_probed_on_the_device(
    ray_env: dict[str, Any], runs: dict[str, Any]
) -> None:
    job_id, error = runs["probed"]
    assert error is None, error
    start = next(e for e in _events(ray_env, job_id) if e.message.startswith("Training "))
    assert "micro-batch 4 probed on the device (planned 4; step peak" in start.message
    assert start.data["micro_batch"] == 4

    _, error = runs["probed-too-small"]
    assert "not even a micro-batch of 1 example fits" in str(error)


def _validated_job(env: dict[str, Any]) -> str:
    """Two workers with a validation file of 3 examples, 2 epochs of 2 steps."""
    with session_scope(env["url"]) as s:
        store = ArtifactStore(env["data"] / "artifacts")
        valid = add_chat_file(s, store, env["principal"].tenant_id, "f-valid", 3)
        req = JobCreateRequest.model_validate(
            {
                "model": BIASED,
                "training_file": env["file"],
                "validation_file": valid,
                "seed": 3,
                "hyperparameters": {
                    "n_epochs": 2,
                    "batch_size": 4,
                    "learning_rate_multiplier": multiplier_for(4e-3),
                },
                "tunefleet": {
                    "max_seq_len": 64,
                    "resources": {"num_workers": 2, "cpus_per_worker": 0.5},
                },
            }
        )
        registry = ModelRegistry(get_settings().resolved_model_registry)
        return create_job(s, env["principal"], req, registry).id


@pytest.mark.runs("validated")
def test_a_validation_file_is_scored_at_checkpoints(
    ray_env: dict[str, Any], runs: dict[str, Any]
) -> None:
    """Loss and next-token accuracy over the whole validation file at every epoch end (the
    checkpoints) and at the end, on both workers' shares; every step's training accuracy
    counts both workers' label tokens."""
    job_id, error = runs["validated"]
    assert error is None, error
    steps = [e.data for e in _events(ray_env, job_id) if e.type == "metrics"]
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    for metrics in steps:
        assert 0 <= metrics["train_mean_token_accuracy"] <= 1
    scored = {m["step"]: m for m in steps if "full_valid_loss" in m}
    assert sorted(scored) == [2, 4]  # 2 steps per epoch
    for metrics in scored.values():
        assert 0 <= metrics["full_valid_mean_token_accuracy"] <= 1
        assert metrics["valid_loss"] == metrics["full_valid_loss"]
        assert metrics["valid_mean_token_accuracy"] == metrics["full_valid_mean_token_accuracy"]
    # the validation examples are the training examples' kind: their loss falls too
    assert scored[4]["full_valid_loss"] < scored[2]["full_valid_loss"]


@pytest.mark.runs("superseded")
def test_a_superseded_run_checkpoints_and_leaves(
    ray_env: dict[str, Any], runs: dict[str, Any]
) -> None:
    """One run per job: a run whose job has another current run stops at its first step
    check, with a checkpoint the current run restores, and leaves no adapter."""
    job_id, error = runs["superseded"]
    assert error is None, error
    events = _events(ray_env, job_id)
    steps = [e.data["step"] for e in events if e.type == "metrics"]
    assert steps == [1], steps  # 8 steps were asked for
    assert any(e.message.startswith("Checkpoint saved at step 1") for e in events)
    store = ArtifactStore(get_settings().resolved_artifact_root)
    assert not store.exists(store.adapter_key(job_id))


@pytest.mark.runs("compiled")
def test_a_compiled_model_trains(ray_env: dict[str, Any], runs: dict[str, Any]) -> None:
    job_id, error = runs["compiled"]
    assert error is None, error
    events = _events(ray_env, job_id)
    start = next(e for e in events if e.message.startswith("Training "))
    assert ", compiled" in start.message
    losses = [e.data["train_loss"] for e in events if e.type == "metrics"]
    assert len(losses) == 4 and losses[-1] < losses[0]
    store = ArtifactStore(get_settings().resolved_artifact_root)  # names as uncompiled
    assert (store.path(store.adapter_key(job_id)) / "adapter_model.safetensors").exists()


def _gpu_cases() -> dict[str, dict[str, Any]]:
    """The jobs bench/gpu_check.py trains (on SmolLM2), here on the tiny model; fp8 needs
    torchao and compute capability 8.9, so only the bench tries it."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from gpu_check import TRAIN

    return {name: options for name, options in TRAIN.items() if name != "fp8_full"}


GPU_CASES = _gpu_cases()


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_a_gpu_worker_trains(ray_env: dict[str, Any], case: str) -> None:
    """One GPU worker: the loss falls, MFU is against the GPU's data-sheet peak (or none
    for a GPU not in the table), peak memory is the GPU's allocator's."""
    options = {**GPU_CASES[case], "resources": {"num_workers": 1, "gpus_per_worker": 1}}
    job_id = _job(ray_env, 4, 20, options)
    run(ray_env, job_id)
    events = _events(ray_env, job_id)
    start = next(e for e in events if e.message.startswith("Training "))
    assert "sheet" in start.data["peak_flops_source"] or "not in" in start.data["peak_flops_source"]
    metrics = [e.data for e in events if e.type == "metrics"]
    assert len(metrics) == 8 and metrics[-1]["train_loss"] < metrics[0]["train_loss"]
    for m in metrics:
        assert m["mfu"] is None if not start.data["peak_flops"] else 0 < m["mfu"] < 1
        assert m["peak_memory_bytes"] > 0


@pytest.mark.runs("tracked")
def test_a_jobs_integrations_hold_its_config_and_metrics(
    ray_env: dict[str, Any], runs: dict[str, Any]
) -> None:
    """A real run on Ray with OpenAI's W&B integration (offline: W&B's run files) and
    TuneFleet's MLflow one (a local SQLite store): each holds every step's loss as the job's events
    do, and the settled config."""
    from tracker_files import mlflow_run, wandb_history, wandb_records

    job_id, error = runs["tracked"]
    assert error is None, error
    events = _events(ray_env, job_id)
    losses = {e.data["step"]: e.data["train_loss"] for e in events if e.type == "metrics"}
    assert sorted(losses) == list(range(1, 9))
    assert not [e.message for e in events if e.level != "info"]  # no integration failed

    steps = wandb_history(ray_env["data"] / "wandb")
    assert {s: round(r["train_loss"], 6) for s, r in steps.items()} == {
        s: round(v, 6) for s, v in losses.items()
    }
    # in the tenant's own project of the operator's account (TUNEFLEET_WANDB_PROJECT_TEMPLATE)
    runs_of_job = (ray_env["data"] / "wandb").rglob(f"offline-run-*-{job_id}/run-*.wandb")
    projects = {
        record.run.project
        for path in runs_of_job
        for record in wandb_records(path)
        if record.WhichOneof("record_type") == "run"
    }
    assert projects == {"acme-tunefleet-tests"}
    # in the tenant's own space of the operator's store (TUNEFLEET_MLFLOW_EXPERIMENT_TEMPLATE)
    client, run = mlflow_run(MLFLOW_STORE(ray_env["data"]), "acme/ci", job_id)
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "train_loss")
    assert {m.step: round(m.value, 6) for m in history} == {
        s: round(v, 6) for s, v in losses.items()
    }
    assert run.data.params["method"] == "lora" and run.data.params["batch_size"] == "4"


@pytest.mark.parametrize(
    "method", [pytest.param(m, marks=pytest.mark.runs(f"dpo-{m}")) for m in DPO_CASES]
)
def test_dpo_learns_the_preferred_answers(
    ray_env: dict[str, Any], runs: dict[str, Any], method: str
) -> None:
    """Loss from log 2 down, rewards of the chosen answers above the rejected ones, on
    the training and the validation pairs, with the reference the method calls for; the
    adapter (or trained weights) stored as a supervised job's are."""
    job_id, error = runs[f"dpo-{method}"]
    assert error is None, error
    events = _events(ray_env, job_id)
    start = next(e for e in events if e.message.startswith("Training "))
    reference = "precomputed" if method == "full" else "adapter disabled"
    assert f"of {method} for DPO (beta 0.5, reference {reference})" in start.message
    assert ": 8 pairs, 0 truncated" in start.message and start.data["objective"] == "dpo"
    precomputed = [e.message for e in events if "precomputed in" in e.message]
    assert len(precomputed) == (1 if method == "full" else 0)
    assert all(m.startswith("Reference log-probabilities of 12 pairs") for m in precomputed)
    metrics = [e.data for e in events if e.type == "metrics"]
    assert [m["step"] for m in metrics] == list(range(1, 9))
    for m in metrics:
        assert "train_mean_token_accuracy" not in m
        assert 0 <= m["rewards/accuracies"] <= 1
        # the mean of the differences against the difference of the means, in float32:
        # a few roundings of numbers no larger than the rewards (relative: cancellation)
        chosen, rejected = m["rewards/chosen"], m["rewards/rejected"]
        bound = 8 * 2**-24 * (abs(chosen) + abs(rejected))
        assert m["rewards/margins"] == pytest.approx(chosen - rejected, rel=0, abs=bound)
        assert m["logps/chosen"] < 0 and m["logps/rejected"] < 0
    # the first step starts at the reference: every pair's loss is log 2 (LoRA and QLoRA
    # start as the base; full fine-tuning's reference is the model before that step), up
    # to the policy's and reference's log-probabilities differing by rounding (about 1e-5:
    # the loss moves by beta/2 times that), far inside 1e-3
    assert metrics[0]["train_loss"] == pytest.approx(math.log(2), abs=1e-3)
    assert metrics[-1]["train_loss"] < 0.5 * math.log(2), [m["train_loss"] for m in metrics]
    assert metrics[-1]["rewards/accuracies"] == 1.0 and metrics[-1]["rewards/margins"] > 0
    scored = {m["step"]: m for m in metrics if "valid_loss" in m}
    assert sorted(scored) == [2, 4, 6, 8]
    assert scored[8]["valid_loss"] < scored[2]["valid_loss"]
    assert scored[8]["valid_rewards/accuracies"] == 1.0
    assert scored[8]["valid_rewards/margins"] > scored[2]["valid_rewards/margins"]

    store = ArtifactStore(get_settings().resolved_artifact_root)
    names = sorted(p.name for p in store.path(store.adapter_key(job_id)).iterdir())
    full = ["trainable.safetensors", "tunefleet_method.json"]
    assert names == (full if method == "full" else PEFT_FILES)


@pytest.mark.runs("lora")
def test_dpo_continues_a_supervised_jobs_adapter(
    ray_env: dict[str, Any], runs: dict[str, Any]
) -> None:
    """SFT then DPO: a DPO job with tunefleet.init_from_job starts from the supervised
    job's adapter, and its reference is that adapted model (scores precomputed before the
    first step, kept in the checkpoints): checked against peft's own load of the
    supervised adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tunefleet.workers.train._dpo import collate_pairs, sequence_logps
    from tunefleet.workers.train._loss import LabelledLogits
    from tunefleet.workers.train.data import load_dataset

    sft_id, error = runs["lora"]
    assert error is None, error
    with session_scope(ray_env["url"]) as s:  # what the controller records at its end
        sft = s.get(Job, sft_id)
        assert sft is not None
        sft.status, sft.fine_tuned_model = "succeeded", f"ft:{BIASED}:acme::{sft_id}"
    lora = CASES["lora"][1]["lora"]
    named = f"ft:{BIASED}:acme::{sft_id}"
    job_id = _dpo_job(ray_env, "lora", lora=lora, init_from_job=named, precision="fp32")
    run(ray_env, job_id)
    events = _events(ray_env, job_id)
    start = next(e for e in events if e.message.startswith("Training "))
    assert f"for DPO (beta 0.5, reference precomputed) from job {sft_id}'s weights" in start.message
    metrics = [e.data for e in events if e.type == "metrics"]
    assert len(metrics) == 8 and metrics[-1]["train_loss"] < metrics[0]["train_loss"]

    settings = get_settings()
    store = ArtifactStore(settings.resolved_artifact_root)
    final = store.path(store.checkpoint_key(job_id, 8)) / "trainer_state.json"
    saved = json.loads(final.read_text())["reference_logps"]
    model_path = settings.resolved_model_registry / BIASED
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    sft_model = PeftModel.from_pretrained(base, str(store.path(store.adapter_key(sft_id)))).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    pairs = load_dataset(store.path(store.file_key(ray_env["pairs"])), tokenizer, 64).examples
    labelled = LabelledLogits(sft_model.get_output_embeddings())
    with torch.no_grad():
        logps = sequence_logps(labelled, sft_model, collate_pairs(pairs, tokenizer.pad_token_id)[0])
    expected = torch.stack([logps[: len(pairs)], logps[len(pairs) :]], 1)
    assert torch.allclose(torch.tensor(saved["train"]).float(), expected, atol=1e-4)
    assert len(saved["valid"]) == len(PREFERENCES)


@pytest.mark.runs("dpo-lora-ddp", "dpo-lora-zero3", "dpo-full-zero3")
def test_dpo_on_two_workers_sharded_trains_like_ddp(
    ray_env: dict[str, Any], runs: dict[str, Any]
) -> None:
    """DPO on two workers: LoRA under ZeRO-3 (the reference with the adapter switched off
    on sharded layers) has DDP's losses and rewards step by step; full fine-tuning under
    ZeRO-3 precomputes the reference on both workers' shares (summed over them) and so
    starts at log 2."""

    def outcome(name: str) -> tuple[list[tuple[float, float, float]], list[Any]]:
        job_id, error = runs[name]
        assert error is None, (name, error)
        events = _events(ray_env, job_id)
        metrics = [e.data for e in events if e.type == "metrics"]
        assert [m["step"] for m in metrics] == list(range(1, 9))
        got = [(m["train_loss"], m["rewards/chosen"], m["rewards/rejected"]) for m in metrics]
        return got, events

    ddp, _ = outcome("dpo-lora-ddp")
    zero3, events = outcome("dpo-lora-zero3")
    assert any("on 2 worker(s) sharded (zero3)" in e.message for e in events)
    for a, b in zip(ddp, zero3, strict=True):
        assert b == pytest.approx(a, rel=1e-4, abs=1e-6), (ddp, zero3)
    assert ddp[0][0] == pytest.approx(math.log(2), abs=1e-3) and ddp[-1][0] < ddp[0][0]

    full, events = outcome("dpo-full-zero3")
    assert any("Reference log-probabilities of 12 pairs" in e.message for e in events)
    assert full[0][0] == pytest.approx(math.log(2), abs=1e-3)
    assert full[-1][0] < 0.5 * math.log(2), full
