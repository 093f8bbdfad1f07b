"""Direct Preference Optimization (Rafailov et al., 2023): the loss, the reference model,
and the batch of a micro-batch of pairs.

For a prompt x with a preferred answer y_w and a non-preferred one y_l, the policy's
implicit reward of an answer is ``beta * (log pi(y|x) - log pi_ref(y|x))``, and

    loss = -log sigmoid(reward(y_w) - reward(y_l)),

averaged over pairs. ``log pi(y|x)`` sums the log-probabilities of the answer's tokens
only (its labels, ``data.PreferencePair``): the prompt is context.

- **One forward pass per micro-batch, the prompt once per pair.** A pair is one row: the
  prompt its two sequences share, then the chosen answer, then the rejected one, with an
  attention mask that lets each answer see the prompt and itself (never the other
  answer) and positions that restart after the prompt for each answer (as packing does
  for documents: ``data.collate_packed``). So the prompt's tokens are computed once, not
  twice, and one forward and one backward serve both answers. The output layer runs only
  at the positions that predict an answer's tokens (``loss.LabelledLogits``): the
  prompt's last position predicts the first token of both.
- **The reference.** ``adapter_disabled``: the same model with its adapter switched off
  (peft's ``disable_adapter``), which is the base; no second copy of the weights.
  ``precomputed``: the log-probabilities of the model the run starts from (full
  fine-tuning, BitFit, bottleneck adapters, a job continuing another's weights), scored
  once before the first step and kept in every checkpoint, so a resumed run compares
  against the same reference.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tunefleet.workers.train._loss import LabelledLogits
from tunefleet.workers.train.data import IGNORE, PreferencePair


def shared_prompt(pair: PreferencePair) -> int:
    """How many leading tokens the pair's sequences share before either's first label."""
    chosen, rejected = pair.chosen, pair.rejected
    n = 0
    for a, b, la, lb in zip(
        chosen.input_ids, rejected.input_ids, chosen.labels, rejected.labels, strict=False
    ):
        if a != b or la != IGNORE or lb != IGNORE:
            break
        n += 1
    return n


def collate_pairs(pairs: list[PreferencePair], pad_id: int) -> tuple[dict[str, torch.Tensor], int]:
    """A batch of one row per pair (shared prompt, chosen answer, rejected answer; right
    padded), and the real tokens its rows hold. Besides the model's inputs it carries,
    flattened over the batch, the position that predicts each answer token
    (``predicted_from``), that token (``targets``) and its sequence (``sequence``: pair i's
    chosen answer is sequence i, its rejected one ``len(pairs) + i``)."""
    shared = [shared_prompt(p) for p in pairs]
    lengths = [
        len(p.chosen.input_ids) + len(p.rejected.input_ids) - n
        for p, n in zip(pairs, shared, strict=True)
    ]
    width = max(lengths)
    ids = torch.full((len(pairs), width), pad_id, dtype=torch.long)
    positions = torch.zeros((len(pairs), width), dtype=torch.long)
    # what a position may attend to: 0 the prompt, 1 the chosen answer, 2 the rejected,
    # padding only itself
    part = torch.arange(3, 3 + width).repeat(len(pairs), 1)
    predicted_from: list[int] = []
    targets: list[int] = []
    sequence: list[int] = []
    for row, (pair, n) in enumerate(zip(pairs, shared, strict=True)):
        ids[row, :n] = torch.tensor(pair.chosen.input_ids[:n], dtype=torch.long)
        positions[row, :n] = torch.arange(n)
        part[row, :n] = 0
        start = n
        for which, ex in enumerate(pair.sequences):
            tail = len(ex.input_ids) - n
            ids[row, start : start + tail] = torch.tensor(ex.input_ids[n:], dtype=torch.long)
            positions[row, start : start + tail] = torch.arange(n, n + tail)
            part[row, start : start + tail] = which + 1
            # the row index of each of the sequence's tokens
            at = list(range(n)) + list(range(start, start + tail))
            for j in range(1, len(ex.input_ids)):
                if ex.labels[j] != IGNORE:
                    predicted_from.append(row * width + at[j - 1])
                    targets.append(ex.labels[j])
                    sequence.append(which * len(pairs) + row)
            start += tail
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    sees = (part[:, :, None] == part[:, None, :]) | (part[:, None, :] == 0)
    batch = {
        "input_ids": ids,
        "position_ids": positions,
        "attention_mask": (sees & causal)[:, None],
        "predicted_from": torch.tensor(predicted_from, dtype=torch.long),
        "targets": torch.tensor(targets, dtype=torch.long),
        "sequence": torch.tensor(sequence, dtype=torch.long),
    }
    return batch, sum(lengths)


def sequence_logps(
    labelled: LabelledLogits, model: Any, batch: dict[str, torch.Tensor]
) -> torch.Tensor:
    """Each sequence's summed log-probability of its label tokens (``[sequences]``, fp32):
    of a ``collate_pairs`` batch, chosen answers first; of a plain one, by row."""
    logits, targets = labelled(model, batch)
    token_logps = -F.cross_entropy(logits.float(), targets, reduction="none")
    if "sequence" in batch:
        which, count = batch["sequence"], 2 * len(batch["input_ids"])
    else:  # the flattened positions, in row order, are the rows' label positions
        which = (batch["labels"][:, 1:] != IGNORE).nonzero(as_tuple=True)[0]
        count = len(batch["labels"])
    sums = torch.zeros(count, dtype=token_logps.dtype, device=token_logps.device)
    return sums.index_add(0, which.to(token_logps.device), token_logps)


def dpo_loss(
    policy: torch.Tensor, reference: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The mean DPO loss over the pairs of ``policy`` and ``reference`` log-probabilities
    (``[2 * pairs]``, chosen first), and each pair's chosen and rejected rewards (no
    gradient)."""
    pairs = len(policy) // 2
    ratios = policy - reference.to(policy.device, policy.dtype)  # precomputed: on the CPU
    chosen, rejected = ratios[:pairs], ratios[pairs:]
    loss = -F.logsigmoid(beta * (chosen - rejected)).mean()
    return loss, (beta * chosen).detach(), (beta * rejected).detach()


class Reference:
    """The reference model's log-probabilities of a micro-batch's sequences."""

    def __init__(
        self,
        kind: str,
        *,
        peft_model: Any = None,
        labelled: LabelledLogits,
    ):
        self.kind = kind
        self._peft_model = peft_model  # adapter_disabled: the model, unwrapped
        self._labelled = labelled
        # precomputed: (split -> [pairs, 2]: chosen, rejected), float64 on the CPU
        self.scores: dict[str, torch.Tensor] = {}

    def logps(self, batch: dict[str, torch.Tensor], split: str, indices: list[int]) -> torch.Tensor:
        """``[2 * len(indices)]``, chosen first, for the pairs ``indices`` of ``split``
        whose rows ``batch`` holds (run under the policy's autocast, if any)."""
        if self.kind == "precomputed":
            scores = self.scores[split][indices]
            return torch.cat([scores[:, 0], scores[:, 1]]).float()
        with torch.no_grad(), self._peft_model.disable_adapter():
            return sequence_logps(self._labelled, self._peft_model, batch)

    def precompute(
        self,
        split: str,
        pairs: list[PreferencePair],
        score: Callable[[list[PreferencePair]], torch.Tensor],
        *,
        micro: int,
        rank: int,
        world: int,
        device: torch.device,
    ) -> None:
        """Score every pair of ``split`` once with ``score`` (the model as it is now, in
        eval mode): each rank its share, in the same number of passes on every rank (FSDP
        gathers in each), summed over the ranks."""
        scores = torch.zeros(len(pairs), 2, dtype=torch.float64, device=device)
        mine = list(range(rank, len(pairs), world))
        passes = math.ceil(math.ceil(len(pairs) / world) / micro)
        with torch.no_grad():
            for i in range(passes):
                chunk = mine[i * micro : (i + 1) * micro]
                logps = score([pairs[j] for j in chunk] or pairs[:1])
                if chunk:
                    half = len(chunk)
                    scores[chunk] = torch.stack([logps[:half], logps[half:]], 1).double()
        if world > 1 and dist.is_available() and dist.is_initialized():
            dist.all_reduce(scores)
        self.scores[split] = scores.cpu()

    def saved(self) -> dict[str, list[list[float]]]:
        """The precomputed scores, for a checkpoint's trainer state (JSON keeps floats
        exactly)."""
        return {split: scores.tolist() for split, scores in self.scores.items()}

    def restore(self, saved: dict[str, list[list[float]]]) -> None:
        self.scores = {
            split: torch.tensor(rows, dtype=torch.float64).reshape(-1, 2)
            for split, rows in saved.items()
        }
