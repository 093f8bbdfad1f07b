"""The training loop, written out in full: ``train_loop_per_worker`` for Ray Train.

Setup (model, adapter, data, optimizer) -> resume from the newest checkpoint -> steps with
metrics to the platform -> checkpoints at epoch ends (and every N steps) -> the final
adapter as the last reported checkpoint. Every worker runs this function; rank 0 alone
reports to the platform (through the run's channel, ``workers/run_channel.py``) and
reports checkpoints to Ray Train.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AutoTokenizer

from tunefleet.platform.artifacts import Keys, open_store
from tunefleet.platform.settings import get_settings
from tunefleet.platform.spec import JobSpec
from tunefleet.workers.run_channel import ChannelReporter
from tunefleet.workers.train import checkpoint as ckpt_files
from tunefleet.workers.train import metrics as train_metrics
from tunefleet.workers.train import probe, sharding
from tunefleet.workers.train.data import (
    collate,
    collate_packed,
    epoch_order,
    load_dataset,
    pack,
)
from tunefleet.workers.train.loss import LabelledLogits, correct_tokens, mean_loss
from tunefleet.workers.train.methods import build_model

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
    make_batch: Any,
    autocast: Any,
    labelled: LabelledLogits,
    start: int,
    share: int,
    world: int,
    fit: probe.DeviceFit,
) -> tuple[int, str]:
    """The seeds' Step 2 (``probe.py``): one forward and backward pass on the longest
    examples per size tried, with the optimizer states the run will add held in memory
    meanwhile; every rank tries the same sizes and a size fits only if it fits on all.
    Returns the micro-batch and a sentence for the job's events."""
    longest = sorted(units, key=lambda u: -len(u.input_ids))
    trainable = sum(  # this worker's share where FSDP shards them
        (p.to_local() if hasattr(p, "to_local") else p).numel()
        for p in model.parameters()
        if p.requires_grad
    )
    state_bytes = trainable * (2 if spec.tunefleet.optimizer != "adamw" else 8)
    device = ray.train.torch.get_device()

    def attempt(size: int) -> None:
        reserve = torch.zeros(state_bytes, dtype=torch.uint8, device=device)  # noqa: F841
        batch, _ = make_batch([longest[i % len(longest)] for i in range(size)])
        with autocast:
            loss = mean_loss(*labelled(model, batch))
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


def train_loop_per_worker(config: dict[str, Any]) -> None:
    entered = time.time()
    spec = JobSpec.model_validate(config["spec"])
    run_id: str = config["run_id"]  # the Ray job id the controller gave this run
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    is_chief = rank == 0
    # what the chief has to say goes to the platform through the run's channel
    reporter = ChannelReporter(run_id)

    # --- setup ----------------------------------------------------------------------
    load_started = time.perf_counter()
    resident_at_start = probe.resident_bytes()
    tokenizer = AutoTokenizer.from_pretrained(config["model_path"])
    pad_id = (
        tokenizer.pad_token_id
        if tokenizer.pad_token_id is not None
        else (tokenizer.eos_token_id or 0)
    )
    built = build_model(spec, config["model_path"])
    trainable, total = built.trainable, built.total
    device_type = ray.train.torch.get_device().type
    # A resumed run loads the method's weights before the model is wrapped or sharded;
    # optimizer and scheduler state once they exist (below).
    resume = contextlib.ExitStack()
    checkpoint = ray.train.get_checkpoint()
    ckpt_dir = Path(resume.enter_context(checkpoint.as_directory())) if checkpoint else None
    if ckpt_dir is not None:
        ckpt_files.load_model(ckpt_dir, built)
    if spec.tunefleet.precision == "fp8":
        enable_fp8(built.model)
    # the output layer runs only where a label is (loss.py); hooked before any wrapping
    labelled = LabelledLogits(built.model.get_output_embeddings())
    strategy = spec.tunefleet.run_strategy
    # one worker has nothing to shard, but zero3_offload still moves its parameters, grads
    # and optimizer states to host memory (GPU workers only: spec.py)
    sharded = strategy != "ddp" and (world > 1 or strategy == "zero3_offload")
    if sharded:
        model = sharding.shard_model(
            built.model.to(ray.train.torch.get_device()), strategy, spec.tunefleet.precision
        )
    else:
        model = ray.train.torch.prepare_model(
            built.model, parallel_strategy="ddp" if world > 1 else None
        )
    if spec.tunefleet.compile:
        # in place (nn.Module.compile): parameter names and state dicts stay the model's
        model.compile(dynamic=True)  # examples vary in length
    autocast = precision_context(spec, device_type)
    # fp16 needs dynamic loss scaling: small gradients would underflow to zero
    scaler = torch.amp.GradScaler(device_type, enabled=spec.tunefleet.precision == "fp16")
    model_load_s = time.perf_counter() - load_started

    # the driver's store; this node's cache (its own settings say where that is)
    store = open_store(**config["store"], cache_dir=get_settings().resolved_artifact_cache)
    data = load_dataset(
        store.local_copy(config["train_key"]), tokenizer, spec.tunefleet.max_seq_len
    )
    if not data.examples:
        raise ValueError("the training file has no example with tokens to learn from")
    # Evaluation data: never packed; every worker scores its share.
    validation = (
        load_dataset(
            store.local_copy(config["validation_key"]), tokenizer, spec.tunefleet.max_seq_len
        )
        if config.get("validation_key")
        else None
    )
    # The unit of a batch: an example, or a row of examples packed end to end.
    units: list[Any] = (
        pack(data.examples, spec.tunefleet.max_seq_len)
        if spec.tunefleet.packing
        else list(data.examples)
    )

    def make_batch(picked: list[Any]) -> tuple[dict[str, torch.Tensor], int]:
        """The model's inputs and their real (not padding) token count."""
        tokens = sum(len(u.input_ids) for u in picked)
        if spec.tunefleet.packing:
            return collate_packed(picked, pad_id), tokens
        return collate(picked, pad_id), tokens

    hp = spec.hyperparameters
    share = max(1, math.ceil(hp.batch_size / world))
    # One optimizer step = `accum` micro-batches of `micro` examples on each of `world`
    # workers: the global batch_size, up to rounding.
    micro = spec.tunefleet.micro_batch_size or share
    probed = ""
    if spec.tunefleet.probe_micro_batch:
        if ckpt_dir is not None:  # a resumed run keeps what its first run found
            micro = int(ckpt_files.saved_extras(ckpt_dir).get("micro_batch", micro))
        else:
            micro, probed = probe_micro_batch(
                spec, model, units, make_batch, autocast, labelled, micro, share, world,
                probe.DeviceFit(
                    ray.train.torch.get_device(),
                    config.get("device_memory_bytes"),
                    resident_at_start,
                ),
            )  # fmt: skip
    accum = max(1, math.ceil(hp.batch_size / (micro * world)))
    per_step = micro * accum
    steps_per_epoch = max(1, math.ceil(len(units) / (per_step * world)))
    total_steps = steps_per_epoch * hp.n_epochs
    if spec.tunefleet.max_steps is not None:
        total_steps = min(total_steps, spec.tunefleet.max_steps)

    optimizer = make_optimizer(spec, [p for p in model.parameters() if p.requires_grad])
    scheduler = linear_schedule(
        optimizer, int(spec.tunefleet.warmup_ratio * total_steps), total_steps
    )

    # --- resume ---------------------------------------------------------------------
    step, trained_tokens = 0, 0
    with resume:
        if ckpt_dir is not None:
            state = ckpt_files.load_state(
                ckpt_dir,
                optimizer,
                scheduler,
                scaler,
                (lambda state: sharding.load_optimizer_state(model, optimizer, state))
                if sharded
                else None,
                rank,
                ray.train.torch.get_device(),
            )
            step, trained_tokens = int(state["step"]), int(state["trained_tokens"])
    # Throughput metrics: model FLOPs per token against the device's peak (metrics.py)
    device = ray.train.torch.get_device()
    peak_flops, peak_source = 0.0, ""
    if is_chief:
        compute = {"bf16": torch.bfloat16, "fp16": torch.float16}
        dtype = compute.get(spec.tunefleet.precision, torch.float32)
        peak_flops, peak_source = train_metrics.device_peak_flops(device, dtype)
    per_token = train_metrics.flops_per_token(
        total, trainable, built.model.config, data.tokens / len(data.examples)
    )
    head = train_metrics.output_layer_flops(total, trainable, built.model.config)
    # where the workers really run, rank by rank (the event says it, next to the
    # controller's placement)
    nodes: list[Any] = [ray.get_runtime_context().get_node_id()]
    if dist.is_available() and dist.is_initialized() and world > 1:
        nodes = [None] * world
        dist.all_gather_object(nodes, ray.get_runtime_context().get_node_id())
    if is_chief:
        checkpointing = spec.tunefleet.run_checkpointing
        resumed = f", resumed at step {step}" if step else ""
        reporter.post(
            "message",
            message=(
                f"Training {total_steps} steps of {spec.tunefleet.method} in "
                f"{spec.tunefleet.precision} on {world} worker(s)"
                f"{f' sharded ({strategy})' if sharded else ''}"
                f"{', compiled' if spec.tunefleet.compile else ''} ({micro} examples x "
                f"{accum} micro-batch(es) per worker per step"
                f"{', gradient checkpointing' if checkpointing else ''}"
                f"): {len(data.examples)} examples"
                f"{f' packed into {len(units)} rows' if spec.tunefleet.packing else ''}, "
                f"{data.truncated} truncated to {spec.tunefleet.max_seq_len} tokens; "
                f"{probed}"
                f"{trainable:,} trainable of {total:,} parameters; workers on node(s) "
                f"{', '.join(sorted(set(nodes)))}{resumed}"
            ),
            data={
                "model_load_s": round(model_load_s, 3),
                "step": step,
                "micro_batch": micro,
                "peak_flops": peak_flops,
                "peak_flops_source": peak_source,
                "flops_per_token": per_token,
                "output_layer_flops_per_token": head,  # counted at labelled positions
                "method": spec.tunefleet.method,
                "nodes": nodes,
                "strategy": strategy if sharded or world > 1 else "single",
                "pid": os.getpid(),
                # seconds since the epoch: the driver's process and its trainer, this
                # worker's process, this function, and the end of set-up
                "startup": {
                    **config.get("startup", {}),
                    "worker_process": psutil.Process().create_time(),
                    "train_fn": entered,
                    "setup_done": time.time(),
                },
                "trainable_parameters": trainable,
                "total_parameters": total,
            },
        )

    saved = [step] if ckpt_dir is not None else []  # steps checkpointed (or restored)

    def save_checkpoint(final: bool, metrics: dict[str, Any]) -> bool:
        """Report a checkpoint into the artifact store as ``checkpoints/{job}/step-N``;
        False on every rank when the disk was full (the run must leave: see ``disk_full``)."""
        name = Keys.checkpoint_name(step)
        # sharded: every rank takes part in gathering the full tensors onto rank 0
        gathered = sharding.gather_state(model, optimizer) if sharded else None
        rng = ckpt_files.rng_states(device, world)
        full = 0
        # what was said so far is in the database before a checkpoint a later run could
        # resume from exists (the channel may die with its Ray: a crash loses no step)
        if is_chief and not reporter.flush(FLUSH_WAIT_S):
            print(f"run {run_id}: the controller has not written its reports in "
                  f"{FLUSH_WAIT_S:.0f}s; checkpointing anyway", flush=True)  # fmt: skip
        with tempfile.TemporaryDirectory() as tmp:
            if is_chief:
                try:
                    ckpt_files.save(
                        Path(tmp),
                        built,
                        spec,
                        optimizer,
                        scheduler,
                        {"step": step, "trained_tokens": trained_tokens, "micro_batch": micro},
                        rng,
                        scaler,
                        gathered,
                    )
                    ray.train.report(
                        {**metrics, "step": step, "final": final},
                        checkpoint=ray.train.Checkpoint.from_directory(tmp),
                        checkpoint_dir_name=name,
                    )
                except OSError as exc:
                    if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                        raise
                    failed = disk_full(exc)
                    full = 1
                    ray.train.report({**metrics, "step": step, "final": False, "failed": failed})
                else:
                    saved.append(step)
                    reporter.post(
                        "checkpoint",
                        step=step,
                        path=f"{config['checkpoints_key']}/{name}",
                        metrics=metrics,
                    )
            else:
                ray.train.report({**metrics, "step": step, "final": final})
        if dist.is_available() and dist.is_initialized() and world > 1:
            flag = torch.tensor([full], device=device)
            dist.broadcast(flag, src=0)
            full = int(flag.item())
        return not full

    def disk_full(exc: OSError) -> dict[str, str | None]:
        """On the chief, a checkpoint that found the disk full: nothing of it is kept (Ray
        Train never saw it), the run records why and leaves, and the job fails with this
        error (not retried: the next run would find the same disk)."""
        previous = f"step {saved[-1]}" if saved else "none"
        message = (
            f"no space left on the device while writing the checkpoint of step {step} "
            f"({exc.filename or exc.strerror}); the newest checkpoint before it ({previous}) "
            "is intact. Free space in the artifact store and the workers' temporary "
            "folder, then create the job again"
        )
        failed = {"code": "disk_full", "message": message, "param": None}
        reporter.post(
            "message",
            message=f"Checkpoint failed: {message}",
            level="error",
            data={"error": failed},
        )
        return failed

    seen: dict[str, Any] = {}  # the stop the controller asked for (its job's status, run)

    def requested_stop() -> str | None:
        """'paused' or 'cancelled' when the controller asked this run to stop (the job was
        paused or cancelled, or resumed before this run saw the pause, or another run is
        now its current one: ``progress.wanted_stop``); rank 0 asks the run's channel and
        every rank learns the answer, so all leave at the same step."""
        code = 0
        if is_chief:
            stop = reporter.sync()
            if stop is not None:
                seen.update(status=stop["status"], current=stop["current"])
                code = {"paused": 1, "cancelled": 2}[stop["stop"]]
        if dist.is_available() and dist.is_initialized() and world > 1:
            flag = torch.tensor([code], device=device)
            dist.broadcast(flag, src=0)
            code = int(flag.item())
        return {1: "paused", 2: "cancelled"}.get(code)

    def global_sum(*local: int) -> list[int]:
        """Counts summed over all workers."""
        if dist.is_available() and dist.is_initialized() and world > 1:
            total = torch.tensor(local, device=device)
            dist.all_reduce(total)
            return [int(v) for v in total.tolist()]
        return list(local)

    def evaluate() -> dict[str, float]:
        """Loss and next-token accuracy over every label token of the validation file
        (OpenAI's ``full_valid_loss`` / ``full_valid_mean_token_accuracy``, and its
        ``valid_loss`` / ``valid_mean_token_accuracy``, which OpenAI takes on a batch of
        the file: here the whole file is that batch). Every rank
        runs the same number of forward passes (FSDP gathers in each), scoring nothing in
        the passes past its share."""
        assert validation is not None
        share = validation.examples[rank::world]
        passes = math.ceil(math.ceil(len(validation.examples) / world) / micro)
        # loss sum, correct, label tokens
        totals = torch.zeros(3, dtype=torch.float64, device=device)
        model.eval()
        with torch.no_grad():
            for i in range(passes):
                chunk = share[i * micro : (i + 1) * micro]
                batch = collate(chunk or validation.examples[:1], pad_id)
                with autocast:
                    logits, targets = labelled(model, batch)
                if not chunk or not len(targets):
                    continue
                totals[0] += float(F.cross_entropy(logits.float(), targets, reduction="sum"))
                totals[1] += int(correct_tokens(logits, targets))
                totals[2] += len(targets)
        model.train()
        if dist.is_available() and dist.is_initialized() and world > 1:
            dist.all_reduce(totals)
        count = max(float(totals[2]), 1.0)
        loss, accuracy = float(totals[0]) / count, float(totals[1]) / count
        return {
            "valid_loss": loss,
            "valid_mean_token_accuracy": accuracy,
            "full_valid_loss": loss,
            "full_valid_mean_token_accuracy": accuracy,
        }

    # --- steps ----------------------------------------------------------------------
    model.train()
    started = time.perf_counter()
    window_tokens = window_samples = window_labels = 0
    start_step = step
    epoch = step // steps_per_epoch
    last_loss = float("nan")
    while step < total_steps:
        order = epoch_order(len(units), spec.seed, epoch)
        # Every rank takes the same number of steps (DDP needs it): short shards wrap.
        mine = order[rank::world] or order
        for local_step in range(step % steps_per_epoch, steps_per_epoch):
            if step >= total_steps:
                break
            window_start = time.perf_counter()  # a step's throughput times its training only
            picks = [mine[(local_step * per_step + j) % len(mine)] for j in range(per_step)]
            step_loss, local_tokens, local_samples, local_labels, local_correct = 0.0, 0, 0, 0, 0
            for a in range(accum):
                picked = [units[i] for i in picks[a * micro : (a + 1) * micro]]
                batch, tokens = make_batch(picked)
                # a packed row holds several examples
                local_samples += sum(len(getattr(u, "lengths", (u,))) for u in picked)
                # DDP all-reduces (FSDP reduce-scatters) gradients on the last micro-batch
                # only.
                sync = a == accum - 1 or not hasattr(model, "no_sync")
                if sharded:
                    model.set_requires_gradient_sync(a == accum - 1)  # type: ignore[operator]
                with contextlib.nullcontext() if sync else model.no_sync():  # type: ignore[operator]
                    with autocast:
                        logits, targets = labelled(model, batch)
                        loss = mean_loss(logits, targets)
                    scaler.scale(loss / accum).backward()
                local_labels += len(targets)
                local_correct += int(correct_tokens(logits, targets))
                step_loss += float(loss.detach()) / accum
                local_tokens += tokens
            scaler.unscale_(optimizer)  # true gradients for clipping (no-op unless fp16)
            grad_norm = torch.nn.utils.clip_grad_norm_(
                [p for p in model.parameters() if p.requires_grad], 1.0
            )
            scaler.step(optimizer)  # skipped when fp16 gradients overflowed
            scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            tokens, samples, labels, correct = global_sum(
                local_tokens, local_samples, local_labels, local_correct
            )
            if device.type == "cuda":  # the optimizer step's kernels may still be queued
                torch.cuda.synchronize(device)
            trained_at = time.perf_counter()  # throughput leaves out the evaluation below
            every = spec.tunefleet.checkpoint_every_steps
            # with a validation file: at every checkpoint and at the end
            evaluated = (
                evaluate()
                if validation is not None
                and (
                    step == total_steps
                    or step % steps_per_epoch == 0
                    or (every and step % every == 0)
                )
                else {}
            )
            norm = float(sharding.local_value(grad_norm))  # on every rank: may communicate
            trained_tokens += tokens
            window_tokens += tokens
            window_samples += samples
            window_labels += labels
            last_loss = step_loss
            if is_chief:
                rate = (step - start_step) / (time.perf_counter() - started)
                elapsed = max(trained_at - window_start, 1e-9)
                tokens_per_s = window_tokens / elapsed
                metrics = {
                    "train_loss": last_loss,
                    # OpenAI's: argmax = label, over the step's label tokens on all workers
                    "train_mean_token_accuracy": correct / labels if labels else None,
                    "learning_rate": scheduler.get_last_lr()[0],
                    "grad_norm": norm,
                    "step_tokens": window_tokens,  # real tokens, all workers
                    "tokens_per_s": tokens_per_s,
                    "samples_per_s": window_samples / elapsed,
                    # of the whole job: every worker's device at its peak
                    "mfu": (window_tokens * (per_token - head) + window_labels * head)
                    / elapsed
                    / (peak_flops * world)
                    if peak_flops
                    else None,
                    "peak_memory_bytes": train_metrics.peak_memory_bytes(device),
                    "epoch": epoch + 1,
                    **evaluated,
                }
                window_tokens = window_samples = window_labels = 0
                reporter.post(
                    "metrics",
                    step=step,
                    total_steps=total_steps,
                    metrics=metrics,
                    trained_tokens=trained_tokens,
                    eta_s=(total_steps - step) / rate if rate > 0 else None,
                )
            if step < total_steps and (stop := requested_stop()):
                if stop == "paused":
                    if not save_checkpoint(False, {"train_loss": last_loss, "stopped": stop}):
                        return
                    if is_chief:
                        message = f"Paused at step {step}"
                        if seen.get("status") != "paused":  # resumed, or superseded
                            message = (
                                f"Run {run_id} checkpointed at step {step} and left: the job "
                                f"is {seen.get('status')} with current run {seen.get('current')}"
                            )
                        reporter.post("message", message=message)
                return
            due = every and step % every == 0 and step % steps_per_epoch and step < total_steps
            if due and not save_checkpoint(False, {"train_loss": last_loss}):
                return
        epoch += 1
        if step < total_steps and not save_checkpoint(False, {"train_loss": last_loss}):
            return

    save_checkpoint(True, {"train_loss": last_loss, "trained_tokens": trained_tokens})
