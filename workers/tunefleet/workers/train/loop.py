"""The training loop, written out in full: ``train_loop_per_worker`` for Ray Train.

Setup (model, adapter, data, optimizer) -> resume from the newest checkpoint -> steps with
metrics to the platform -> checkpoints at epoch ends (and every N steps) -> the final
adapter as the last reported checkpoint. Every worker runs this function; rank 0 alone
writes to the database and reports checkpoints.
"""

from __future__ import annotations

import contextlib
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from sqlalchemy import select
from transformers import AutoModelForCausalLM, AutoTokenizer, get_linear_schedule_with_warmup

from tunefleet.platform.db import Job, session_scope
from tunefleet.platform.progress import record_checkpoint, record_message, record_metrics
from tunefleet.platform.spec import JobSpec
from tunefleet.workers.train import checkpoint as ckpt_files
from tunefleet.workers.train.data import collate, epoch_order, load_dataset


def build_model(spec: JobSpec, model_path: str) -> Any:
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    if spec.tunefleet.gradient_checkpointing is True:
        # Non-reentrant checkpointing needs no input that requires grad, so it works with
        # frozen embeddings under LoRA.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = spec.tunefleet.lora
    targets: list[str] | str = (
        "all-linear" if lora.target_modules == ["all-linear"] else list(lora.target_modules)
    )
    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def train_loop_per_worker(config: dict[str, Any]) -> None:
    spec = JobSpec.model_validate(config["spec"])
    db_url: str = config["database_url"]
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    is_chief = rank == 0

    # --- setup ----------------------------------------------------------------------
    load_started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(config["model_path"])
    pad_id = (
        tokenizer.pad_token_id
        if tokenizer.pad_token_id is not None
        else (tokenizer.eos_token_id or 0)
    )
    model = build_model(spec, config["model_path"])
    trainable, total = model.get_nb_trainable_parameters()
    model = ray.train.torch.prepare_model(model, parallel_strategy="ddp" if world > 1 else None)
    peft_model = model.module if hasattr(model, "module") else model
    model_load_s = time.perf_counter() - load_started

    data = load_dataset(Path(config["train_path"]), tokenizer, spec.tunefleet.max_seq_len)
    if not data.examples:
        raise ValueError("the training file has no example with tokens to learn from")
    hp = spec.hyperparameters
    # One optimizer step = `accum` micro-batches of `micro` examples on each of `world`
    # workers: the global batch_size, up to rounding.
    micro = spec.tunefleet.micro_batch_size or max(1, math.ceil(hp.batch_size / world))
    accum = max(1, math.ceil(hp.batch_size / (micro * world)))
    per_step = micro * accum
    steps_per_epoch = max(1, math.ceil(len(data.examples) / (per_step * world)))
    total_steps = steps_per_epoch * hp.n_epochs
    if spec.tunefleet.max_steps is not None:
        total_steps = min(total_steps, spec.tunefleet.max_steps)

    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=spec.learning_rate,
        weight_decay=0.0,
        foreach=True,
    )
    scheduler = get_linear_schedule_with_warmup(
        optimizer, int(spec.tunefleet.warmup_ratio * total_steps), total_steps
    )

    # --- resume ---------------------------------------------------------------------
    step, trained_tokens = 0, 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as ckpt_dir:
            saved = ckpt_files.load(Path(ckpt_dir), peft_model, optimizer, scheduler)
            step, trained_tokens = int(saved["step"]), int(saved["trained_tokens"])
    if is_chief:
        with session_scope(db_url) as s:
            resumed = f", resumed at step {step}" if step else ""
            record_message(
                s,
                spec.job_id,
                f"Training {total_steps} steps on {world} worker(s) ({micro} examples x "
                f"{accum} micro-batch(es) per worker per step"
                f"{', gradient checkpointing' if spec.tunefleet.gradient_checkpointing else ''}"
                f"): {len(data.examples)} examples, {data.truncated} truncated to "
                f"{spec.tunefleet.max_seq_len} tokens; "
                f"{trainable:,} trainable of {total:,} parameters{resumed}",
                data={"model_load_s": round(model_load_s, 3), "step": step},
            )

    def save_checkpoint(final: bool, metrics: dict[str, Any]) -> None:
        """Report a checkpoint into the artifact store as ``checkpoints/{job}/step-N``."""
        name = f"step-{step:08d}"
        with tempfile.TemporaryDirectory() as tmp:
            if is_chief:
                ckpt_files.save(
                    Path(tmp),
                    peft_model,
                    optimizer,
                    scheduler,
                    {"step": step, "trained_tokens": trained_tokens},
                )
                ray.train.report(
                    {**metrics, "step": step, "final": final},
                    checkpoint=ray.train.Checkpoint.from_directory(tmp),
                    checkpoint_dir_name=name,
                )
                with session_scope(db_url) as s:
                    record_checkpoint(
                        s,
                        spec.job_id,
                        step=step,
                        path=f"{config['checkpoints_key']}/{name}",
                        metrics=metrics,
                    )
            else:
                ray.train.report({**metrics, "step": step, "final": final})

    def requested_stop() -> str | None:
        """'paused' or 'cancelled' when the platform asked this job to stop; rank 0 reads
        the database and every rank learns the answer, so all leave at the same step."""
        code = 0
        if is_chief:
            with session_scope(db_url) as s:
                status = s.scalar(select(Job.status).where(Job.id == spec.job_id))
            code = {"paused": 1, "cancelled": 2}.get(status or "", 0)
        if dist.is_available() and dist.is_initialized() and world > 1:
            flag = torch.tensor([code])
            dist.broadcast(flag, src=0)
            code = int(flag.item())
        return {1: "paused", 2: "cancelled"}.get(code)

    def global_tokens(local: int) -> int:
        if dist.is_available() and dist.is_initialized() and world > 1:
            total = torch.tensor([local])
            dist.all_reduce(total)
            return int(total.item())
        return local

    # --- steps ----------------------------------------------------------------------
    model.train()
    started, window_tokens, window_start = time.perf_counter(), 0, time.perf_counter()
    start_step = step
    epoch = step // steps_per_epoch
    last_loss = float("nan")
    while step < total_steps:
        order = epoch_order(len(data.examples), spec.seed, epoch)
        # Every rank takes the same number of steps (DDP needs it): short shards wrap.
        mine = order[rank::world] or order
        for local_step in range(step % steps_per_epoch, steps_per_epoch):
            if step >= total_steps:
                break
            picks = [mine[(local_step * per_step + j) % len(mine)] for j in range(per_step)]
            step_loss, local_tokens = 0.0, 0
            for a in range(accum):
                batch = collate(
                    [data.examples[i] for i in picks[a * micro : (a + 1) * micro]], pad_id
                )
                # DDP all-reduces gradients on the last micro-batch only.
                sync = a == accum - 1 or not hasattr(model, "no_sync")
                with contextlib.nullcontext() if sync else model.no_sync():  # type: ignore[operator]
                    out = model(**batch)
                    (out.loss / accum).backward()
                step_loss += float(out.loss.detach()) / accum
                local_tokens += int(batch["attention_mask"].sum())
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            tokens = global_tokens(local_tokens)
            trained_tokens += tokens
            window_tokens += tokens
            last_loss = step_loss
            if is_chief:
                now = time.perf_counter()
                rate = (step - start_step) / (now - started)
                metrics = {
                    "train_loss": last_loss,
                    "learning_rate": scheduler.get_last_lr()[0],
                    "grad_norm": float(grad_norm),
                    "tokens_per_s": window_tokens / max(now - window_start, 1e-9),
                    "epoch": epoch + 1,
                }
                window_tokens, window_start = 0, now
                with session_scope(db_url) as s:
                    record_metrics(
                        s,
                        spec.job_id,
                        step=step,
                        total_steps=total_steps,
                        metrics=metrics,
                        trained_tokens=trained_tokens,
                        eta_s=(total_steps - step) / rate if rate > 0 else None,
                    )
            if step < total_steps and (stop := requested_stop()):
                if stop == "paused":
                    save_checkpoint(False, {"train_loss": last_loss, "stopped": stop})
                    if is_chief:
                        with session_scope(db_url) as s:
                            record_message(s, spec.job_id, f"Paused at step {step}")
                return
            every = spec.tunefleet.checkpoint_every_steps
            if every and step % every == 0 and step % steps_per_epoch and step < total_steps:
                save_checkpoint(False, {"train_loss": last_loss})
        epoch += 1
        if step < total_steps:
            save_checkpoint(False, {"train_loss": last_loss})

    save_checkpoint(True, {"train_loss": last_loss, "trained_tokens": trained_tokens})
