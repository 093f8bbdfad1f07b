"""Next-token logits only where a label is.

A causal LM's own loss runs the output layer at every position and then ignores those
whose next token carries no label: the prompt, the padding, the last position. The output
layer is the model's widest matrix (SmolLM2-135M: 49,152 x 576, a fifth of its FLOPs per
token, and its logits the largest activation), so on chat data, where the prompt is often
half the tokens or more, that is real waste. ``LabelledLogits`` hooks the output layer
once and hands it only the hidden states of positions whose next token is a label; the
cross-entropy over them is the model's loss (mean over label tokens), with the same
gradients, at less cost and memory; the same logits give the token accuracy
(``correct_tokens``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from tunefleet.workers.train.data import IGNORE

# What a batch may carry besides the model's inputs: the labels (-100 where none), or the
# labelled positions given outright, flattened over the batch, with their targets (and the
# sequence each belongs to: ``dpo.collate_pairs``, where one position predicts two tokens)
NOT_MODEL_INPUTS = ("labels", "predicted_from", "targets", "sequence")


class LabelledLogits:
    """``logits, targets = labelled(model, batch)``: the logits at the positions whose
    next token has a label, flattened over the batch (``[K, vocab]``), and those labels
    (``[K]``); or, for a batch with ``predicted_from`` (flat positions) and ``targets``,
    the logits at those positions and those targets. ``output_layer`` is the model's
    (``get_output_embeddings()``); it is hooked for the object's lifetime and acts only
    inside a call."""

    def __init__(self, output_layer: torch.nn.Module):
        self._batch: dict[str, torch.Tensor] | None = None
        self._targets: torch.Tensor | None = None
        output_layer.register_forward_pre_hook(self._select)

    def _select(self, _module: Any, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if self._batch is None:
            return None
        if "predicted_from" in self._batch:
            hidden = args[0]
            self._targets = self._batch["targets"]
            flat = hidden.reshape(-1, hidden.shape[-1])
            return (flat[self._batch["predicted_from"]], *args[1:])
        hidden, labels = args[0], self._batch["labels"]
        # prompt tuning puts its virtual tokens before the inputs (unlabelled; the last
        # one predicts the first input token, as in peft's own loss)
        extra = hidden.shape[1] - labels.shape[1]
        if extra < 0:
            raise RuntimeError(
                f"the output layer got {hidden.shape[1]} positions for {labels.shape[1]} "
                "labels: call the model without logits_to_keep"
            )
        if extra:
            labels = F.pad(labels, (extra, 0), value=IGNORE)
        predicts = labels[:, 1:] != IGNORE  # position t predicts token t+1
        self._targets = labels[:, 1:][predicts]
        return (hidden[F.pad(predicts, (0, 1))], *args[1:])

    def __call__(
        self, model: Any, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._batch = batch
        try:
            out = model(**{k: v for k, v in batch.items() if k not in NOT_MODEL_INPUTS})
            targets = self._targets
        finally:
            self._batch = self._targets = None
        if targets is None:
            raise RuntimeError("the model did not call its output layer")
        return out.logits, targets


def mean_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The causal LM loss: cross-entropy averaged over label tokens, in fp32."""
    return F.cross_entropy(logits.float(), targets)


def correct_tokens(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """How many label tokens are the logits' argmax (a 0-d int64 tensor, no gradient):
    the numerator of OpenAI's ``mean_token_accuracy``, whose denominator is
    ``len(targets)``. Counts, not a mean, so that micro-batches and ranks add up."""
    with torch.no_grad():
        return (logits.argmax(-1) == targets).sum()
