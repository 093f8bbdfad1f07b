"""The training loop for Ray Train, as a recipe: ``train_loop_per_worker`` reads top to
bottom.

``Worker`` sets up once (model, adapter, data, the micro-batch plan, optimizer); its
``TrainState`` (step, tokens trained, epoch) comes from the newest checkpoint or starts at
zero; then ``Worker.train`` runs the steps, with metrics to the platform, checkpoints at
epoch ends (and every N steps), a stop when the controller asks, and the final adapter as
the last reported checkpoint. Every worker runs it; rank 0 alone reports to the platform
(through the run's channel, ``workers/_run_channel.py``) and reports checkpoints to Ray
Train.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AutoTokenizer

from tunefleet.platform.artifacts import Keys, cache_of, open_store
from tunefleet.platform.model_cache import local_model
from tunefleet.platform.outbound import OutboundPolicy
from tunefleet.platform.settings import get_settings
from tunefleet.platform.spec import JobSpec
from tunefleet.workers._precision import settle as settle_precision
from tunefleet.workers._run_channel import ChannelReporter
from tunefleet.workers.train import _checkpoint as ckpt_files
from tunefleet.workers.train import _metrics as train_metrics
from tunefleet.workers.train import _probe as probe
from tunefleet.workers.train import _sharding as sharding
from tunefleet.workers.train._dpo import Reference, collate_pairs, dpo_loss, sequence_logps
from tunefleet.workers.train._loss import LabelledLogits, correct_tokens, mean_loss
from tunefleet.workers.train._methods import build_model, load_weights
from tunefleet.workers.train._trackers import Trackers, job_config
from tunefleet.workers.train.data import (
    TokenizedDataset,
    collate,
    collate_packed,
    epoch_order,
    load_dataset,
    pack,
    unit_tokens,
)

# How long the chief waits at a checkpoint for the controller to write its reports (the
# database may be away a while); then it checkpoints anyway.
FLUSH_WAIT_S = 600.0


def make_optimizer(spec: JobSpec, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW with its fused kernel (one kernel per step for all parameters, on CPUs and
    GPUs), or bitsandbytes' 8-bit AdamW (its paged variant on GPUs)."""
    name = spec.tunefleet.optimizer
    if name == "adamw":
        return torch.optim.AdamW(params, lr=spec.learning_rate, weight_decay=0.0, fused=True)
    from bitsandbytes import optim as bnb_optim

    cls: Any = getattr(bnb_optim, "PagedAdamW8bit" if name == "paged_adamw_8bit" else "AdamW8bit")
    optimizer: torch.optim.Optimizer = cls(params, lr=spec.learning_rate, weight_decay=0.0)
    return optimizer


def linear_schedule(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up from 0 to the optimizer's rate over ``warmup_steps``, then linear
    decay to 0 at ``total_steps``: transformers' ``get_linear_schedule_with_warmup``,
    written here because importing it pulls in its Trainer's modules (seconds of start-up
    on every worker)."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return step / max(1, warmup_steps)
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def precision_context(spec: JobSpec, device_type: str) -> Any:
    """Autocast for bf16 and fp16 (weights and optimizer states stay fp32); nothing for fp32
    (fp8 converts the linear layers instead, see ``enable_fp8``)."""
    precision = spec.tunefleet.precision
    if precision in ("bf16", "fp16"):
        dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        return torch.autocast(device_type=device_type, dtype=dtype)
    return contextlib.nullcontext()


def enable_fp8(model: Any) -> None:
    """Float8 training of the linear layers (torchao), on GPUs of compute capability 8.9+,
    except the output layer: it stays in the autocast dtype (as torchtitan does), and the
    loss runs it on the labelled positions only, a row count fp8 GEMMs cannot take."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        raise RuntimeError(
            "tunefleet.precision 'fp8' needs a GPU of compute capability 8.9 or newer "
            "(Hopper, Ada); this worker has "
            + (torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")
        )
    try:
        from torchao.float8 import convert_to_float8_training  # type: ignore[import-not-found]
    except ImportError as exc:
        raise RuntimeError("tunefleet.precision 'fp8' needs torchao on the workers") from exc
    output_layer = model.get_output_embeddings()
    convert_to_float8_training(model, module_filter_fn=lambda m, _fqn: m is not output_layer)


def probe_micro_batch(
    spec: JobSpec,
    model: Any,
    units: list[Any],
    step_loss: Any,
    autocast: Any,
    *,
    start: int,
    share: int,
    world: int,
    fit: probe.DeviceFit,
) -> tuple[int, str]:
    """The seeds' Step 2 (``probe.py``): one forward and backward pass on the longest
    examples per size tried, with the optimizer states the run will add held in memory
    meanwhile; every rank tries the same sizes and a size fits only if it fits on all.
    Returns the micro-batch and a sentence for the job's events."""
    longest = sorted(units, key=lambda u: -unit_tokens(u))
    trainable = sum(  # this worker's share where FSDP shards them
        (p.to_local() if hasattr(p, "to_local") else p).numel()
        for p in model.parameters()
        if p.requires_grad
    )
    state_bytes = trainable * (2 if spec.tunefleet.optimizer != "adamw" else 8)
    device = ray.train.torch.get_device()

    def attempt(size: int) -> None:
        reserve = torch.zeros(state_bytes, dtype=torch.uint8, device=device)  # noqa: F841
        with autocast:
            loss = step_loss([longest[i % len(longest)] for i in range(size)])
        loss.backward()
        model.zero_grad(set_to_none=True)

    def fits(size: int) -> bool:
        ok = fit(size, lambda: attempt(size))
        if dist.is_available() and dist.is_initialized() and world > 1:
            flag = torch.tensor([int(ok)], device=device)  # NCCL reduces device tensors
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            ok = bool(flag.item())
        return ok

    micro, failed = probe.search(fits, start, share)
    peak = fit.peaks.get(micro)
    return micro, (
        f"micro-batch {micro} probed on the device (planned {start}"
        + (f"; {', '.join(map(str, failed))} did not fit" if failed else "")
        + (f"; step peak {peak / 2**20:.0f} MiB" if peak is not None else "")
        + "); "
    )


def preference_metrics(counts: Counts, prefix: str = "") -> dict[str, float]:
    """DPO's metrics over the pairs of ``counts`` (TRL's names): the mean implicit reward
    of the chosen and of the rejected answers, their mean margin, the share of pairs
    whose chosen answer has the higher reward, and the policy's mean log-probabilities of
    each answer."""
    pairs = max(counts.samples, 1)
    return {
        f"{prefix}rewards/chosen": counts.chosen_rewards / pairs,
        f"{prefix}rewards/rejected": counts.rejected_rewards / pairs,
        f"{prefix}rewards/margins": (counts.chosen_rewards - counts.rejected_rewards) / pairs,
        f"{prefix}rewards/accuracies": counts.preferred / pairs,
        f"{prefix}logps/chosen": counts.chosen_logps / pairs,
        f"{prefix}logps/rejected": counts.rejected_logps / pairs,
    }


def train_loop_per_worker(config: dict[str, Any]) -> None:
    entered = time.time()
    worker = Worker(config)
    state = worker.resume()
    worker.announce(state, entered)
    try:
        worker.train(state)
    finally:
        if worker.trackers is not None:
            worker.trackers.finish(completed=state.step >= worker.total_steps)


@dataclass
class TrainState:
    """What changes as a run trains; a checkpoint keeps it, a resumed run starts from it."""

    step: int = 0
    trained_tokens: int = 0
    epoch: int = 0
    last_loss: float = float("nan")
    saved: list[int] = field(default_factory=list)  # steps checkpointed (or restored)
    # the stop the controller asked for: its job's status and current run
    stop_seen: dict[str, Any] = field(default_factory=dict)


@dataclass
class Counts:
    """Tokens, examples and label tokens (and labels predicted right) over all workers;
    for DPO, sums over pairs of the rewards, of the policy's log-probabilities, and of the
    pairs whose chosen answer has the higher reward."""

    tokens: float = 0
    samples: float = 0
    labels: float = 0
    correct: float = 0
    computed: float = 0  # tokens the model ran (a pair's prompt once), for MFU
    chosen_rewards: float = 0
    rejected_rewards: float = 0
    chosen_logps: float = 0
    rejected_logps: float = 0
    preferred: float = 0
    pair_losses: float = 0  # evaluation: the pairs' summed loss

    def add(self, other: Counts) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def values(self) -> list[float]:
        return [getattr(self, name) for name in self.__dataclass_fields__]


class Worker:
    """One worker of a run: what it sets up once, and what it does each step."""

    def __init__(self, config: dict[str, Any]):
        self.config = config
        self.spec = spec = JobSpec.model_validate(config["spec"])
        self.run_id: str = config["run_id"]  # the Ray job id the controller gave this run
        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        self.is_chief = self.rank == 0
        # what the chief has to say goes to the platform through the run's channel
        self.reporter = ChannelReporter(self.run_id)
        self.trackers: Trackers | None = None  # the job's integrations (the chief's, once set up)
        self.device = ray.train.torch.get_device()
        # precision "auto" settled on this run's devices (the first event says why)
        precision, self.precision_why = settle_precision(
            spec.tunefleet.precision, self.device, self.world
        )
        if precision != spec.tunefleet.precision:
            opts = spec.tunefleet.model_copy(update={"precision": precision})
            self.spec = spec = spec.model_copy(update={"tunefleet": opts})

        # the driver's store; this node's cache (its own settings say where that is)
        store = open_store(**config["store"], **cache_of(get_settings()))

        # -- the model -----------------------------------------------------------------
        load_started = time.perf_counter()
        resident_at_start = probe.resident_bytes()
        # from this node's copy of the base model where there is a model cache
        with local_model(config["model_path"], get_settings()) as model_path:
            tokenizer = AutoTokenizer.from_pretrained(model_path)
            self.pad_id = (
                tokenizer.pad_token_id
                if tokenizer.pad_token_id is not None
                else (tokenizer.eos_token_id or 0)
            )
            self.built = built = build_model(spec, str(model_path))
        # A resumed run loads the method's weights before the model is wrapped or sharded;
        # optimizer and scheduler state once they exist (``resume``).
        self._resume = contextlib.ExitStack()
        checkpoint = ray.train.get_checkpoint()
        self.ckpt_dir = (
            Path(self._resume.enter_context(checkpoint.as_directory())) if checkpoint else None
        )
        if self.ckpt_dir is not None:
            ckpt_files.load_model(self.ckpt_dir, built)
        elif config.get("init_key"):  # the weights of the job it starts from
            with store.pinned_copy(config["init_key"]) as weights:  # kept while read
                load_weights(weights, built)
        if spec.tunefleet.precision == "fp8":
            enable_fp8(built.model)
        # the output layer runs only where a label is (loss.py); hooked before any wrapping
        self.labelled = LabelledLogits(built.model.get_output_embeddings())
        self.strategy = strategy = spec.tunefleet.run_strategy
        # one worker has nothing to shard, but zero3_offload still moves its parameters,
        # grads and optimizer states to host memory (GPU workers only: spec.py)
        self.sharded = strategy != "ddp" and (self.world > 1 or strategy == "zero3_offload")
        if self.sharded:
            self.model: Any = sharding.shard_model(
                built.model.to(self.device), strategy, spec.tunefleet.precision
            )
        else:
            self.model = ray.train.torch.prepare_model(
                built.model, parallel_strategy="ddp" if self.world > 1 else None
            )
        if spec.tunefleet.compile:
            # in place (nn.Module.compile): parameter names and state dicts stay the model's
            self.model.compile(dynamic=True)  # examples vary in length
        self.autocast = precision_context(spec, self.device.type)
        # fp16 needs dynamic loss scaling: small gradients would underflow to zero
        self.scaler = torch.amp.GradScaler(
            self.device.type, enabled=spec.tunefleet.precision == "fp16"
        )
        self.model_load_s = time.perf_counter() - load_started

        # DPO's reference log-probabilities (dpo.py): the model with its adapter off, or
        # scores taken before the first step (``resume``)
        self.reference = (
            Reference(
                spec.dpo.reference,
                peft_model=built.model,
                labelled=self.labelled,
            )
            if spec.dpo is not None
            else None
        )

        # -- the data ------------------------------------------------------------------
        max_len = spec.tunefleet.max_seq_len
        with store.pinned_copy(config["train_key"]) as train_file:  # kept while read
            self.data = load_dataset(train_file, tokenizer, max_len)
        if not self.data.examples:
            raise ValueError("the training file has no example with tokens to learn from")
        if self.data.preference != spec.is_dpo:
            raise ValueError(
                "a DPO job trains on preference pairs, and a supervised job on anything else: "
                f"this {spec.objective} job's training file does not match"
            )
        # Evaluation data: never packed; every worker scores its share.
        self.validation: TokenizedDataset | None = None
        if config.get("validation_key"):
            with store.pinned_copy(config["validation_key"]) as validation_file:
                self.validation = load_dataset(validation_file, tokenizer, max_len)
        # The unit of a batch: an example, or a row of examples packed end to end.
        self.units: list[Any] = (
            pack(self.data.examples, max_len)
            if spec.tunefleet.packing
            else list(self.data.examples)
        )

        # -- the steps: `accum` micro-batches of `micro` examples on each of `world`
        # workers make one optimizer step of the global batch_size, up to rounding -------
        hp = spec.hyperparameters
        share = max(1, math.ceil(hp.batch_size / self.world))
        self.micro = spec.tunefleet.micro_batch_size or share
        self.probed = ""
        if spec.tunefleet.probe_micro_batch:
            if self.ckpt_dir is not None:  # a resumed run keeps what its first run found
                saved = ckpt_files.saved_extras(self.ckpt_dir)
                self.micro = int(saved.get("micro_batch", self.micro))
            else:
                self.micro, self.probed = probe_micro_batch(
                    spec,
                    self.model,
                    self.units,
                    lambda picked: self.loss_and_counts(picked, None)[0],
                    self.autocast,
                    start=self.micro,
                    share=share,
                    world=self.world,
                    fit=probe.DeviceFit(
                        self.device, config.get("device_memory_bytes"), resident_at_start
                    ),
                )
        self.accum = max(1, math.ceil(hp.batch_size / (self.micro * self.world)))
        self.per_step = self.micro * self.accum
        self.steps_per_epoch = max(1, math.ceil(len(self.units) / (self.per_step * self.world)))
        self.total_steps = self.steps_per_epoch * hp.n_epochs
        if spec.tunefleet.max_steps is not None:
            self.total_steps = min(self.total_steps, spec.tunefleet.max_steps)
        self.trained_params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(spec, self.trained_params)
        self.scheduler = linear_schedule(
            self.optimizer, int(spec.tunefleet.warmup_ratio * self.total_steps), self.total_steps
        )

        # -- throughput: model FLOPs per token against the device's peak (metrics.py) -----
        self.peak_flops, self.peak_source = 0.0, ""
        if self.is_chief:
            compute = {"bf16": torch.bfloat16, "fp16": torch.float16}
            dtype = compute.get(spec.tunefleet.precision, torch.float32)
            self.peak_flops, self.peak_source = train_metrics.device_peak_flops(self.device, dtype)
        sequences = len(self.data.examples) * (2 if self.data.preference else 1)
        self.flops_per_token = train_metrics.flops_per_token(
            built.total, built.trainable, built.model.config, self.data.tokens / sequences
        )
        self.head_flops = train_metrics.output_layer_flops(
            built.total, built.trainable, built.model.config
        )

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and self.world > 1

    def make_batch(self, picked: list[Any]) -> tuple[dict[str, torch.Tensor], int]:
        """The model's inputs on this worker's device, and the real (not padding) tokens
        it computes: a pair is one row, its prompt computed once for both answers
        (``dpo.collate_pairs``)."""
        if self.reference is not None:
            batch, tokens = collate_pairs(picked, self.pad_id)
        elif self.spec.tunefleet.packing:
            batch, tokens = collate_packed(picked, self.pad_id), sum(map(unit_tokens, picked))
        else:
            batch, tokens = collate(picked, self.pad_id), sum(map(unit_tokens, picked))
        return self.on_device(batch), tokens

    def on_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``batch`` on this worker's device (as it is, on a CPU worker)."""
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def loss_and_counts(
        self, picked: list[Any], indices: list[int] | None, split: str = "train"
    ) -> tuple[torch.Tensor, Counts]:
        """The loss of a micro-batch of units (run under autocast), and its counts on this
        worker. For DPO, ``indices`` are the pairs' places in ``split`` (their precomputed
        reference scores); None (the micro-batch probe) compares against zeros."""
        batch, computed = self.make_batch(picked)
        tokens = sum(unit_tokens(u) for u in picked)  # a pair's: both sequences'
        samples = sum(len(getattr(u, "lengths", (u,))) for u in picked)  # packed rows
        if self.reference is None:
            logits, targets = self.labelled(self.model, batch)
            correct = int(correct_tokens(logits, targets))
            return mean_loss(logits, targets), Counts(
                tokens, samples, len(targets), correct, computed=computed
            )
        assert self.spec.dpo is not None
        if indices is None and self.reference.kind == "precomputed":
            reference = torch.zeros(2 * len(picked), device=self.device)
        else:
            reference = self.reference.logps(batch, split, indices or [])
        policy = sequence_logps(self.labelled, self.model, batch)
        loss, chosen, rejected = dpo_loss(policy, reference, self.spec.dpo.beta)
        logps = policy.detach()
        return loss, Counts(
            tokens,
            samples,
            len(batch["targets"]),
            computed=computed,
            chosen_rewards=float(chosen.sum()),
            rejected_rewards=float(rejected.sum()),
            chosen_logps=float(logps[: len(picked)].sum()),
            rejected_logps=float(logps[len(picked) :].sum()),
            preferred=float((chosen > rejected).sum()),
        )

    # -- the run's start -----------------------------------------------------------------
    def resume(self) -> TrainState:
        """The state of the newest checkpoint (optimizer, scheduler and scaler loaded into
        this worker's), or a fresh one."""
        state = TrainState()
        with self._resume:
            if self.ckpt_dir is not None:
                saved = ckpt_files.load_state(
                    self.ckpt_dir,
                    self.optimizer,
                    self.scheduler,
                    self.scaler,
                    (lambda s: sharding.load_optimizer_state(self.model, self.optimizer, s))
                    if self.sharded
                    else None,
                    self.rank,
                    self.device,
                )
                state.step, state.trained_tokens = int(saved["step"]), int(saved["trained_tokens"])
                state.saved.append(state.step)
                if self.reference is not None and self.reference.kind == "precomputed":
                    self.reference.restore(saved["reference_logps"])
        state.epoch = state.step // self.steps_per_epoch
        # a fresh run's model is still the one it starts from
        if self.reference is not None and self.reference.kind == "precomputed" and not state.step:
            self.precompute_reference()
        return state

    def precompute_reference(self) -> None:
        """Score every training and validation pair with the model as it starts (DPO's
        ``precomputed`` reference), in eval mode; checkpoints keep the scores."""
        assert self.reference is not None
        started = time.perf_counter()
        self.model.eval()
        splits = {"train": self.data.examples}
        if self.validation is not None:
            splits["valid"] = self.validation.examples
        for split, pairs in splits.items():

            def score(picked: list[Any]) -> torch.Tensor:
                with self.autocast:
                    return sequence_logps(self.labelled, self.model, self.make_batch(picked)[0])

            self.reference.precompute(
                split, pairs, score, micro=self.micro, rank=self.rank, world=self.world,
                device=self.device,
            )  # fmt: skip
        self.model.train()
        if self.is_chief:
            self.reporter.post(
                "message",
                message=(
                    f"Reference log-probabilities of {sum(map(len, splits.values()))} "
                    f"pairs precomputed in {time.perf_counter() - started:.1f}s"
                ),
            )

    def announce(self, state: TrainState, entered: float) -> None:
        """The run's first event: what it trains, how, and where its workers run (rank by
        rank, next to the controller's placement)."""
        nodes: list[Any] = [ray.get_runtime_context().get_node_id()]
        if self.distributed:
            nodes = [None] * self.world
            dist.all_gather_object(nodes, ray.get_runtime_context().get_node_id())
        if not self.is_chief:
            return
        built, opts = self.built, self.spec.tunefleet
        if self.spec.integrations:
            settled = {"micro_batch": self.micro, "accumulation": self.accum, "workers": self.world}
            self.trackers = Trackers(
                self.spec,
                job_config(self.spec, **settled, strategy=self.strategy),
                warn=lambda message: self.reporter.post("message", message=message, level="warn"),
                environment=self.config.get("integration_env"),
                outbound=OutboundPolicy.from_allow(self.config.get("outbound_allow", ())),
            )
        resumed = f", resumed at step {state.step}" if state.step else ""
        dpo = self.spec.dpo
        objective = (
            f" for DPO (beta {dpo.beta:g}, reference {dpo.reference.replace('_', ' ')})"
            if dpo is not None
            else ""
        )
        started_from = f" from job {opts.init_from_job}'s weights" if opts.init_from_job else ""
        self.reporter.post(
            "message",
            message=(
                f"Training {self.total_steps} steps of {opts.method}{objective}"
                f"{started_from} in "
                f"{opts.precision}{f' ({self.precision_why})' if self.precision_why else ''} "
                f"on {self.world} worker(s)"
                f"{f' sharded ({self.strategy})' if self.sharded else ''}"
                f"{', compiled' if opts.compile else ''} ({self.micro} examples x "
                f"{self.accum} micro-batch(es) per worker per step"
                f"{', gradient checkpointing' if opts.run_checkpointing else ''}"
                f"): {len(self.data.examples)} {'pairs' if dpo else 'examples'}"
                f"{f' packed into {len(self.units)} rows' if opts.packing else ''}, "
                f"{self.data.truncated} truncated to {opts.max_seq_len} tokens; "
                f"{self.probed}"
                f"{built.trainable:,} trainable of {built.total:,} parameters; workers on "
                f"node(s) {', '.join(sorted(set(nodes)))}{resumed}"
            ),
            data={
                "model_load_s": round(self.model_load_s, 3),
                "step": state.step,
                "micro_batch": self.micro,
                "peak_flops": self.peak_flops,
                "peak_flops_source": self.peak_source,
                "flops_per_token": self.flops_per_token,
                "output_layer_flops_per_token": self.head_flops,  # at labelled positions
                "method": opts.method,
                "precision": opts.precision,
                "objective": self.spec.objective,
                "nodes": nodes,
                "strategy": self.strategy if self.sharded or self.world > 1 else "single",
                "pid": os.getpid(),
                # seconds since the epoch: the driver's process and its trainer, this
                # worker's process, this function, and the end of set-up
                "startup": {
                    **self.config.get("startup", {}),
                    "worker_process": psutil.Process().create_time(),
                    "train_fn": entered,
                    "setup_done": time.time(),
                },
                "trainable_parameters": built.trainable,
                "total_parameters": built.total,
            },
        )

    # -- the steps -----------------------------------------------------------------------
    def train(self, state: TrainState) -> None:
        """Steps to ``total_steps``, epoch by epoch; returns early when the controller asks
        the run to stop or a checkpoint finds the disk full."""
        spec, every = self.spec, self.spec.tunefleet.checkpoint_every_steps
        self.model.train()
        started, start_step = time.perf_counter(), state.step
        window = Counts()  # since the last metrics report
        while state.step < self.total_steps:
            order = epoch_order(len(self.units), spec.seed, state.epoch)
            # Every rank takes the same number of steps (DDP needs it): short shards wrap.
            mine = order[self.rank :: self.world] or order
            for local_step in range(state.step % self.steps_per_epoch, self.steps_per_epoch):
                if state.step >= self.total_steps:
                    break
                step_started = time.perf_counter()  # throughput times the training only
                picks = [
                    mine[(local_step * self.per_step + j) % len(mine)] for j in range(self.per_step)
                ]
                loss, counts, grad_norm = self.optimizer_step(picks)
                state.step += 1
                if self.device.type == "cuda":  # the optimizer step's kernels may be queued
                    torch.cuda.synchronize(self.device)
                trained_at = time.perf_counter()  # throughput leaves out the evaluation
                evaluated = self.evaluate() if self.evaluates_at(state.step) else {}
                norm = float(sharding.local_value(grad_norm))  # every rank: may communicate
                state.trained_tokens += int(counts.tokens)
                state.last_loss = loss
                window.add(counts)
                if self.is_chief:
                    rate = (state.step - start_step) / (time.perf_counter() - started)
                    elapsed = max(trained_at - step_started, 1e-9)
                    self.report_metrics(
                        state,
                        loss=loss,
                        counts=counts,
                        window=window,
                        grad_norm=norm,
                        elapsed=elapsed,
                        rate=rate,
                        evaluated=evaluated,
                    )
                    window = Counts()
                if state.step < self.total_steps and (stop := self.requested_stop(state)):
                    if stop == "paused":
                        self.pause(state)
                    return
                due = (
                    every
                    and state.step % every == 0
                    and state.step % self.steps_per_epoch
                    and state.step < self.total_steps
                )
                if due and not self.save_checkpoint(state, False, {"train_loss": loss}):
                    return
            state.epoch += 1
            if state.step < self.total_steps and not self.save_checkpoint(
                state, False, {"train_loss": state.last_loss}
            ):
                return
        final = {"train_loss": state.last_loss, "trained_tokens": state.trained_tokens}
        self.save_checkpoint(state, True, final)

    def optimizer_step(self, picks: list[int]) -> tuple[float, Counts, torch.Tensor]:
        """One optimizer step over ``accum`` micro-batches of the units ``picks``: the
        step's mean loss on this worker, its counts over all workers, the gradient norm."""
        model, micro, accum = self.model, self.micro, self.accum
        step_loss, local = 0.0, Counts()
        for a in range(accum):
            indices = picks[a * micro : (a + 1) * micro]
            # DDP all-reduces (FSDP reduce-scatters) gradients on the last micro-batch only.
            sync = a == accum - 1 or not hasattr(model, "no_sync")
            if self.sharded:
                model.set_requires_gradient_sync(a == accum - 1)
            with contextlib.nullcontext() if sync else model.no_sync():
                with self.autocast:
                    loss, counts = self.loss_and_counts([self.units[i] for i in indices], indices)
                self.scaler.scale(loss / accum).backward()
            local.add(counts)
            step_loss += float(loss.detach()) / accum
        self.scaler.unscale_(self.optimizer)  # true gradients for clipping (fp16 only)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trained_params, 1.0)
        self.scaler.step(self.optimizer)  # skipped when fp16 gradients overflowed
        self.scaler.update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return step_loss, self.global_sum(local), grad_norm

    def report_metrics(
        self,
        state: TrainState,
        *,
        loss: float,
        counts: Counts,
        window: Counts,
        grad_norm: float,
        elapsed: float,
        rate: float,
        evaluated: dict[str, float],
    ) -> None:
        """The chief's metrics event of a step (``window``: the steps since the last)."""
        metrics: dict[str, Any] = {"train_loss": loss}
        if self.reference is None:
            # OpenAI's: argmax = label, over the step's label tokens on all workers
            metrics["train_mean_token_accuracy"] = (
                counts.correct / counts.labels if counts.labels else None
            )
        else:
            metrics.update(preference_metrics(counts))
        metrics |= {
            "learning_rate": self.scheduler.get_last_lr()[0],
            "grad_norm": grad_norm,
            "step_tokens": int(window.tokens),  # real tokens, all workers
            "tokens_per_s": window.tokens / elapsed,
            "samples_per_s": window.samples / elapsed,
            "mfu": train_metrics.mfu(
                tokens=int(window.computed),
                labels=int(window.labels),
                flops_per_token=self.flops_per_token,
                output_layer_flops=self.head_flops,
                seconds=elapsed,
                peak_flops=self.peak_flops * self.world,
            ),
            "peak_memory_bytes": train_metrics.peak_memory_bytes(self.device),
            "epoch": state.epoch + 1,
            **evaluated,
        }
        if self.trackers is not None:
            self.trackers.log(state.step, metrics)
        self.reporter.post(
            "metrics",
            step=state.step,
            total_steps=self.total_steps,
            metrics=metrics,
            trained_tokens=state.trained_tokens,
            eta_s=(self.total_steps - state.step) / rate if rate > 0 else None,
        )

    def global_sum(self, local: Counts) -> Counts:
        """Counts summed over all workers."""
        if self.distributed:
            total = torch.tensor(local.values(), dtype=torch.float64, device=self.device)
            dist.all_reduce(total)
            return Counts(*total.tolist())
        return local

    # -- evaluation ----------------------------------------------------------------------
    def evaluates_at(self, step: int) -> bool:
        """With a validation file: at every checkpoint and at the end."""
        every = self.spec.tunefleet.checkpoint_every_steps
        return self.validation is not None and (
            step == self.total_steps
            or step % self.steps_per_epoch == 0
            or bool(every and step % every == 0)
        )

    def evaluate(self) -> dict[str, float]:
        """Loss and next-token accuracy over every label token of the validation file
        (OpenAI's ``full_valid_loss`` / ``full_valid_mean_token_accuracy``, and its
        ``valid_loss`` / ``valid_mean_token_accuracy``, which OpenAI takes on a batch of
        the file: here the whole file is that batch). Every rank runs the same number of
        forward passes (FSDP gathers in each), scoring nothing in the passes past its
        share."""
        validation, micro, model = self.validation, self.micro, self.model
        assert validation is not None
        if self.reference is not None:
            return self.evaluate_preferences()
        share = validation.examples[self.rank :: self.world]
        passes = math.ceil(math.ceil(len(validation.examples) / self.world) / micro)
        # loss sum, correct, label tokens
        totals = torch.zeros(3, dtype=torch.float64, device=self.device)
        model.eval()
        with torch.no_grad():
            for i in range(passes):
                chunk = share[i * micro : (i + 1) * micro]
                batch = self.on_device(collate(chunk or validation.examples[:1], self.pad_id))
                with self.autocast:
                    logits, targets = self.labelled(model, batch)
                if not chunk or not len(targets):
                    continue
                totals[0] += float(F.cross_entropy(logits.float(), targets, reduction="sum"))
                totals[1] += int(correct_tokens(logits, targets))
                totals[2] += len(targets)
        model.train()
        if self.distributed:
            dist.all_reduce(totals)
        count = max(float(totals[2]), 1.0)
        loss, accuracy = float(totals[0]) / count, float(totals[1]) / count
        return {
            "valid_loss": loss,
            "valid_mean_token_accuracy": accuracy,
            "full_valid_loss": loss,
            "full_valid_mean_token_accuracy": accuracy,
        }

    def evaluate_preferences(self) -> dict[str, float]:
        """DPO's loss and metrics over every pair of the validation file, as ``evaluate``
        runs its passes."""
        validation, micro, dpo = self.validation, self.micro, self.spec.dpo
        assert validation is not None and dpo is not None
        mine = list(range(self.rank, len(validation.examples), self.world))
        passes = math.ceil(math.ceil(len(validation.examples) / self.world) / micro)
        totals = Counts()
        self.model.eval()
        with torch.no_grad():
            for i in range(passes):
                chunk = mine[i * micro : (i + 1) * micro]
                picked = [validation.examples[j] for j in chunk] or validation.examples[:1]
                with self.autocast:
                    loss, counts = self.loss_and_counts(picked, chunk or [0], "valid")
                if chunk:
                    counts.pair_losses = float(loss) * len(chunk)
                    totals.add(counts)
        self.model.train()
        totals = self.global_sum(totals)
        mean = totals.pair_losses / max(totals.samples, 1)
        return {
            "valid_loss": mean,
            "full_valid_loss": mean,
            **preference_metrics(totals, "valid_"),
        }

    # -- stopping and checkpoints ------------------------------------------------------
    def requested_stop(self, state: TrainState) -> str | None:
        """'paused' or 'cancelled' when the controller asked this run to stop (the job was
        paused or cancelled, or resumed before this run saw the pause, or another run is
        now its current one: ``progress.wanted_stop``); rank 0 asks the run's channel and
        every rank learns the answer, so all leave at the same step."""
        code = 0
        if self.is_chief:
            stop = self.reporter.sync()
            if stop is not None:
                state.stop_seen.update(status=stop["status"], current=stop["current"])
                code = {"paused": 1, "cancelled": 2}[stop["stop"]]
        return {1: "paused", 2: "cancelled"}.get(self.from_chief(code))

    def pause(self, state: TrainState) -> None:
        """Checkpoint and say so: the next run continues from here."""
        if not self.save_checkpoint(
            state, False, {"train_loss": state.last_loss, "stopped": "paused"}
        ):
            return
        if self.is_chief:
            message = f"Paused at step {state.step}"
            seen = state.stop_seen
            if seen.get("status") != "paused":  # resumed, or superseded
                message = (
                    f"Run {self.run_id} checkpointed at step {state.step} and left: the job "
                    f"is {seen.get('status')} with current run {seen.get('current')}"
                )
            self.reporter.post("message", message=message)

    def from_chief(self, value: int) -> int:
        """Rank 0's ``value`` on every rank."""
        if self.distributed:
            flag = torch.tensor([value], device=self.device)
            dist.broadcast(flag, src=0)
            value = int(flag.item())
        return value

    def save_checkpoint(self, state: TrainState, final: bool, metrics: dict[str, Any]) -> bool:
        """Report a checkpoint into the artifact store as ``checkpoints/{job}/step-N``;
        False on every rank when the disk was full (the run must leave: see ``disk_full``)."""
        name = Keys.checkpoint_name(state.step)
        # sharded: every rank takes part in gathering the full tensors onto rank 0
        gathered = sharding.gather_state(self.model, self.optimizer) if self.sharded else None
        rng = ckpt_files.rng_states(self.device, self.world)
        full = 0
        # what was said so far is in the database before a checkpoint a later run could
        # resume from exists (the channel may die with its Ray: a crash loses no step)
        if self.is_chief and not self.reporter.flush(FLUSH_WAIT_S):
            print(f"run {self.run_id}: the controller has not written its reports in "
                  f"{FLUSH_WAIT_S:.0f}s; checkpointing anyway", flush=True)  # fmt: skip
        reported = {**metrics, "step": state.step, "final": final}
        with tempfile.TemporaryDirectory() as tmp:
            if not self.is_chief:
                ray.train.report(reported)
            else:
                try:
                    ckpt_files.save(
                        Path(tmp),
                        self.built,
                        self.spec,
                        self.optimizer,
                        self.scheduler,
                        extra={
                            "step": state.step,
                            "trained_tokens": state.trained_tokens,
                            "micro_batch": self.micro,
                            **(
                                {"reference_logps": self.reference.saved()}
                                if self.reference is not None and self.reference.scores
                                else {}
                            ),
                        },
                        rng=rng,
                        scaler=self.scaler,
                        gathered=gathered,
                    )
                    ray.train.report(
                        reported,
                        checkpoint=ray.train.Checkpoint.from_directory(tmp),
                        checkpoint_dir_name=name,
                    )
                except OSError as exc:
                    if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                        raise
                    failed = self.disk_full(state, exc)
                    full = 1
                    ray.train.report({**reported, "final": False, "failed": failed})
                else:
                    state.saved.append(state.step)
                    self.reporter.post(
                        "checkpoint",
                        step=state.step,
                        path=f"{self.config['checkpoints_key']}/{name}",
                        metrics=metrics,
                    )
        return not self.from_chief(full)

    def disk_full(self, state: TrainState, exc: OSError) -> dict[str, str | None]:
        """On the chief, a checkpoint that found the disk full: nothing of it is kept (Ray
        Train never saw it), the run records why and leaves, and the job fails with this
        error (not retried: the next run would find the same disk)."""
        previous = f"step {state.saved[-1]}" if state.saved else "none"
        message = (
            f"no space left on the device while writing the checkpoint of step {state.step} "
            f"({exc.filename or exc.strerror}); the newest checkpoint before it ({previous}) "
            "is intact. Free space in the artifact store and the workers' temporary "
            "folder, then create the job again"
        )
        failed = {"code": "disk_full", "message": message, "param": None}
        self.reporter.post(
            "message",
            message=f"Checkpoint failed: {message}",
            level="error",
            data={"error": failed},
        )
        return failed
