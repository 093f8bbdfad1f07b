"""What a job gets for the hyperparameters it leaves at ``"auto"``: settled once, when the
job is made, from its training file's size, its workers and its base model's width, each
with the reason, which the job's first event states (docs/training.md, "Defaults").

The evidence is ``bench/efficacy.py`` (four held-out tasks on SmolLM2-135M, the defaults
against a grid of hand-set configurations) with the rules of OpenAI's fine-tuning and of
"LoRA Without Regret" (Schulman et al., Thinking Machines, 2025) for what one small model
cannot show: how the learning rate falls as models get wider.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tunefleet.platform.spec import BASE_LEARNING_RATE, Hyperparameters

# n_epochs "auto", OpenAI's rule (their chat fine-tuning data-preparation cookbook): 3
# epochs, unless that shows the model fewer than MIN_SEEN or more than MAX_SEEN examples in
# all; never past MAX_EPOCHS.
TARGET_EPOCHS = 3
MIN_SEEN = 100
MAX_SEEN = 25_000
MAX_EPOCHS = 25

# batch_size "auto": about STEPS_PER_EPOCH optimizer steps an epoch, as a power of two
# within [MIN_BATCH, MAX_BATCH] (LoRA learns less per example from large batches than full
# fine-tuning does: "LoRA Without Regret"), and at least one example per worker.
STEPS_PER_EPOCH = 32
MIN_BATCH = 4
MAX_BATCH = 32

# The learning rate of LoRA, QLoRA and full fine-tuning of a Llama-family model (the
# multiplier's 1.0), Thinking Machines' fit: LR = 5e-5 x M x (2000 / hidden_size) ** 0.781,
# with M = 10 for LoRA and 1 for full fine-tuning: 1.3e-3 for SmolLM2-135M (576 wide),
# 2.9e-4 for an 8B (4096), 1.7e-4 for a 70B (8192). Their fit is of models 2048 wide and
# more, the suite's check at 576: narrower models (test models) get the rate at MIN_WIDTH.
WIDTH_SCALED = {"lora": 10.0, "qlora": 10.0, "full": 1.0}
LR_AT_2000 = 5e-5
WIDTH_EXPONENT = 0.781
MIN_WIDTH = 512
# DPO's rate, a tenth of the supervised one: preference tuning moves a model that already
# answers well, and at the supervised rate its log-probabilities of both answers fall
# together (the DPO paper trains at 5e-7 to 1e-6 in full; TRL's and the alignment
# handbook's LoRA recipes at 5e-6 to 5e-5, against 2e-4 for supervised LoRA).
DPO_LR_FACTOR = 0.1


def n_epochs(examples: int | None) -> tuple[int, str]:
    """Epochs for a training file of ``examples`` (None: not known), and why."""
    if not examples:
        return TARGET_EPOCHS, "the training file's size is not known"
    if examples * TARGET_EPOCHS < MIN_SEEN:
        n = min(MAX_EPOCHS, math.ceil(MIN_SEEN / examples))
        return n, f"{examples} examples: {n} epochs show the model at least {MIN_SEEN}"
    if examples * TARGET_EPOCHS > MAX_SEEN:
        n = max(1, MAX_SEEN // examples)
        return n, f"{examples} examples: {n} epoch(s) show the model at most {MAX_SEEN}"
    return TARGET_EPOCHS, f"{examples} examples"


def batch_size(examples: int | None, workers: int) -> tuple[int, str]:
    """The global batch for a training file of ``examples`` on ``workers``, and why."""
    if not examples:
        size, why = MIN_BATCH, "the training file's size is not known"
    else:
        size = 2 ** round(math.log2(max(1.0, examples / STEPS_PER_EPOCH)))
        size = min(MAX_BATCH, max(MIN_BATCH, size))
        why = f"{examples} examples: about {math.ceil(examples / size)} steps an epoch"
    if size < workers:
        size, why = workers, f"one example per worker ({workers})"
    return size, why


def base_learning_rate(
    method: str, config: dict[str, Any], objective: str = "supervised"
) -> tuple[float, str]:
    """The learning rate a multiplier of 1.0 means for ``method`` on a model of ``config``
    (its ``config.json``) training for ``objective``, and why."""
    scale = WIDTH_SCALED.get(method)
    hidden = config.get("hidden_size")
    if scale is None or not hidden:
        lr, why = BASE_LEARNING_RATE[method], f"{method}'s base rate"
    else:
        lr = LR_AT_2000 * scale * (2000 / max(MIN_WIDTH, int(hidden))) ** WIDTH_EXPONENT
        why = f"{method} on a model {hidden} wide"
    if objective == "dpo":
        lr, why = lr * DPO_LR_FACTOR, f"DPO: a tenth of {why}'s supervised rate"
    return float(f"{lr:.3g}"), why


@dataclass(frozen=True)
class Settled:
    """A job's hyperparameters with every "auto" resolved, and what each auto became and
    why (for the job's first event)."""

    hyperparameters: Hyperparameters
    base_learning_rate: float
    reasons: dict[str, str]

    def describe(self) -> str:
        hp = self.hyperparameters
        said = {
            "n_epochs": f"n_epochs {hp.n_epochs}",
            "batch_size": f"batch_size {hp.batch_size}",
            "learning_rate_multiplier": f"learning rate {self.base_learning_rate:.3g}",
        }
        parts = [f"{said[k]} ({why})" for k, why in self.reasons.items()]
        return "auto settled " + "; ".join(parts) if parts else ""


def settle(
    asked: dict[str, Any], *, method: str, config: dict[str, Any], examples: int | None,
    workers: int, objective: str = "supervised",
) -> Settled:  # fmt: skip
    """Resolve the hyperparameters ``asked`` (``n_epochs``, ``batch_size``,
    ``learning_rate_multiplier``, each a value or "auto")."""
    reasons: dict[str, str] = {}
    epochs, batch, multiplier = (
        asked["n_epochs"], asked["batch_size"], asked["learning_rate_multiplier"]
    )  # fmt: skip
    if epochs == "auto":
        epochs, reasons["n_epochs"] = n_epochs(examples)
    if batch == "auto":
        batch, reasons["batch_size"] = batch_size(examples, workers)
    base, why = base_learning_rate(method, config, objective)
    if multiplier == "auto":
        multiplier, reasons["learning_rate_multiplier"] = 1.0, why
    return Settled(
        Hyperparameters(n_epochs=epochs, batch_size=batch, learning_rate_multiplier=multiplier),
        base,
        reasons,
    )
