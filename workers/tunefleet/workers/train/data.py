"""Turn a validated JSONL file into token ids and loss labels.

Loss is computed only on what the model should learn to write: assistant turns with
weight 1 (chat, alpaca) or the completion (prompt/completion); ``text`` trains on every
token. Labels of other tokens are -100. Examples longer than ``max_seq_len`` are truncated
and counted. A preference line (DPO) becomes a ``PreferencePair``: the prompt with each
answer, labelled on the answer alone.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tunefleet.platform.datasets import detect_format

IGNORE = -100
_PLACEHOLDER = "\x00tunefleet-content\x00"


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]


@dataclass
class PreferencePair:
    """A prompt with its preferred (``chosen``) and non-preferred (``rejected``) answer:
    two whole sequences, each labelled on its answer (and the end-of-turn text the chat
    template writes after it), never on the prompt."""

    chosen: Example
    rejected: Example

    @property
    def sequences(self) -> tuple[Example, Example]:
        return self.chosen, self.rejected


Unit = Example | PreferencePair


def unit_tokens(unit: Any) -> int:
    """The tokens of an example, a packed row, or both sequences of a pair."""
    if isinstance(unit, PreferencePair):
        return len(unit.chosen.input_ids) + len(unit.rejected.input_ids)
    return len(unit.input_ids)


@dataclass
class TokenizedDataset:
    examples: list[Any]  # Example, or PreferencePair for a preference file
    truncated: int

    @property
    def tokens(self) -> int:
        return sum(unit_tokens(e) for e in self.examples)

    @property
    def preference(self) -> bool:
        return bool(self.examples) and isinstance(self.examples[0], PreferencePair)


def _marker(i: int) -> str:
    return f"\x00tunefleet-{i}\x00"


def _chat_example(tokenizer: Any, messages: list[dict[str, Any]]) -> Example:
    """Render with the chat template; label each trained assistant turn's span: its content
    and the end-of-turn text the template writes after an assistant message.

    The template is rendered a fixed number of times whatever the number of turns (once
    with every content replaced by a marker, to find where each content goes, and once
    with the contents), and the labels are one pass over the tokens: the cost is linear in
    the conversation. A template that changes contents (so that the contents put back in
    place of the markers do not give its render) is labelled turn by turn, as before, for
    conversations of up to ``_PER_TURN_LIMIT`` trained turns.
    """
    clean = [{"role": m["role"], "content": m.get("content") or ""} for m in messages]
    full = tokenizer.apply_chat_template(clean, tokenize=False)
    trained = [
        i for i, m in enumerate(messages) if m["role"] == "assistant" and m.get("weight", 1) != 0
    ]
    spans = _spans_by_markers(tokenizer, clean, full, trained)
    if spans is None:
        spans = _spans_turn_by_turn(tokenizer, clean, trained)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    labels = []
    k = 0  # spans are in order, and so are the tokens' offsets
    for tok, (a, _b) in zip(enc["input_ids"], enc["offset_mapping"], strict=True):
        while k < len(spans) and spans[k][1] <= a:
            k += 1
        labels.append(tok if k < len(spans) and spans[k][0] <= a else IGNORE)
    return Example(list(enc["input_ids"]), labels)


def _spans_by_markers(
    tokenizer: Any, clean: list[dict[str, str]], full: str, trained: list[int]
) -> list[tuple[int, int]] | None:
    """Each trained turn's (start, end) in ``full``, from one render with markers for the
    contents; None when the template does not keep contents as they are."""
    marked = [{**m, "content": _marker(i)} for i, m in enumerate(clean)]
    skeleton = tokenizer.apply_chat_template(marked, tokenize=False)
    # what the template writes after an assistant's content (ChatML: "<|im_end|>\n")
    pair = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _marker(0)}]
    after = tokenizer.apply_chat_template(pair, tokenize=False).split(_marker(0))[-1]
    pieces, starts, at, pos = [], [], 0, 0
    for i, m in enumerate(clean):
        found = skeleton.find(_marker(i), at)
        if found < 0:
            return None
        pieces.append(skeleton[at:found])
        pos += found - at
        starts.append(pos)
        pieces.append(m["content"])
        pos += len(m["content"])
        at = found + len(_marker(i))
    pieces.append(skeleton[at:])
    if "".join(pieces) != full:
        return None
    spans = []
    for i in trained:
        end = starts[i] + len(clean[i]["content"])
        if after and full.startswith(after, end):
            end += len(after)
        spans.append((starts[i], end))
    return spans


# Above this many trained turns, a template that changes contents is refused rather than
# labelled turn by turn (each turn renders the conversation up to it).
_PER_TURN_LIMIT = 64


def _spans_turn_by_turn(
    tokenizer: Any, clean: list[dict[str, str]], trained: list[int]
) -> list[tuple[int, int]]:
    """The span of assistant message i is the text between the render of messages[:i] with
    a generation prompt and the render of messages[:i+1]."""
    if len(trained) > _PER_TURN_LIMIT:
        raise ValueError(
            f"a conversation with {len(trained)} trained assistant turns, with a chat "
            f"template that changes message contents, is over the {_PER_TURN_LIMIT} turns "
            "TuneFleet labels turn by turn; split it into shorter conversations"
        )
    spans = []
    for i in trained:
        if i:
            prefix = tokenizer.apply_chat_template(
                clean[:i], tokenize=False, add_generation_prompt=True
            )
            start = len(prefix)
        else:  # no messages to prompt with: where the template puts the content, after
            # whatever it writes first (a role header, a default system prompt)
            alone = [{**clean[0], "content": _PLACEHOLDER}]
            start = tokenizer.apply_chat_template(alone, tokenize=False).rfind(_PLACEHOLDER)
        end = len(tokenizer.apply_chat_template(clean[: i + 1], tokenize=False))
        spans.append((start, end))
    return spans


def _prompt_completion(tokenizer: Any, prompt: str, completion: str) -> Example:
    p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    c = tokenizer(completion, add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id is not None:
        c = [*c, tokenizer.eos_token_id]
    return Example([*p, *c], [IGNORE] * len(p) + list(c))


def _preference_pair(tokenizer: Any, obj: dict[str, Any]) -> PreferencePair:
    """Both answers after the prompt, rendered by the chat template; assistant turns of
    the prompt are context, not trained."""
    prompt = [
        {**m, "weight": 0} if m.get("role") == "assistant" else m for m in obj["input"]["messages"]
    ]
    return PreferencePair(
        _chat_example(tokenizer, [*prompt, obj["preferred_output"][0]]),
        _chat_example(tokenizer, [*prompt, obj["non_preferred_output"][0]]),
    )


def tokenize_example(tokenizer: Any, obj: dict[str, Any]) -> Unit:
    fmt = detect_format(obj)
    if fmt == "preference":
        return _preference_pair(tokenizer, obj)
    if fmt == "chat":
        return _chat_example(tokenizer, obj["messages"])
    if fmt == "alpaca":
        prompt = obj["instruction"] + (("\n\n" + obj["input"]) if obj.get("input") else "")
        return _chat_example(
            tokenizer,
            [{"role": "user", "content": prompt}, {"role": "assistant", "content": obj["output"]}],
        )
    if fmt == "prompt_completion":
        return _prompt_completion(tokenizer, obj["prompt"], obj["completion"])
    ids = tokenizer(obj["text"], add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id is not None:
        ids = [*ids, tokenizer.eos_token_id]
    return Example(list(ids), list(ids))


def _learnable(ex: Example) -> bool:
    return any(label != IGNORE for label in ex.labels[1:])


def load_dataset(path: Path, tokenizer: Any, max_seq_len: int) -> TokenizedDataset:
    """The file's examples (or pairs), each sequence cut to ``max_seq_len`` tokens; those
    left with no label to learn (a pair: either answer) are dropped."""
    examples: list[Any] = []
    truncated = 0
    with path.open("rb") as fh:
        for raw in fh:
            if not raw.strip():
                continue
            unit = tokenize_example(tokenizer, json.loads(raw))
            sequences: tuple[Example, ...] = (
                unit.sequences if isinstance(unit, PreferencePair) else (unit,)
            )
            if any(len(ex.input_ids) > max_seq_len for ex in sequences):
                truncated += 1
                sequences = tuple(
                    Example(ex.input_ids[:max_seq_len], ex.labels[:max_seq_len]) for ex in sequences
                )
            if all(_learnable(ex) for ex in sequences):
                examples.append(PreferencePair(*sequences) if len(sequences) == 2 else sequences[0])
    return TokenizedDataset(examples, truncated)


def token_stats(
    path: Path, tokenizer: Any, max_seq_len: int, *, check: Callable[[], None] | None = None
) -> dict[str, int]:
    """What a file holds in the base model's tokens: examples, tokens, trained (loss)
    tokens, and examples longer than ``max_seq_len`` (truncated when training). A
    preference pair is one example; its tokens and trained tokens are both answers'.
    ``check`` runs before each line and may raise to stop (a deadline, a shutdown)."""
    stats = {
        "examples": 0,
        "tokens": 0,
        "trained_tokens": 0,
        "over_max_seq_len": 0,
        "max_seq_len": max_seq_len,
    }
    with path.open("rb") as fh:
        for raw in fh:
            if check is not None:
                check()
            if not raw.strip():
                continue
            unit = tokenize_example(tokenizer, json.loads(raw))
            sequences = unit.sequences if isinstance(unit, PreferencePair) else (unit,)
            stats["examples"] += 1
            stats["tokens"] += sum(len(ex.input_ids) for ex in sequences)
            stats["trained_tokens"] += sum(
                label != IGNORE for ex in sequences for label in ex.labels
            )
            stats["over_max_seq_len"] += any(len(ex.input_ids) > max_seq_len for ex in sequences)
    return stats


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The example order of one epoch: a shuffle determined by (seed, epoch) alone."""
    order = list(range(n))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def collate(examples: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a batch to its longest example (dynamic padding, not max_seq_len)."""
    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, ex in enumerate(examples):
        n = len(ex.input_ids)
        ids[row, :n] = torch.tensor(ex.input_ids)
        labels[row, :n] = torch.tensor(ex.labels)
        mask[row, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


@dataclass
class PackedRow:
    """Several examples laid end to end in one row of at most ``max_seq_len`` tokens."""

    input_ids: list[int]
    labels: list[int]
    lengths: list[int]  # of each document, in order


def pack(examples: list[Example], max_seq_len: int) -> list[PackedRow]:
    """First-fit-decreasing packing of examples into rows of ``max_seq_len`` tokens; the
    first label of every document is ignored (nothing before it in its document predicts
    it). Deterministic for a given list."""
    rows: list[PackedRow] = []
    space: list[int] = []
    for ex in sorted(examples, key=lambda e: -len(e.input_ids)):
        n = len(ex.input_ids)
        labels = [IGNORE, *ex.labels[1:]]
        for i, free in enumerate(space):
            if free >= n:
                rows[i].input_ids += ex.input_ids
                rows[i].labels += labels
                rows[i].lengths.append(n)
                space[i] -= n
                break
        else:
            rows.append(PackedRow(list(ex.input_ids), labels, [n]))
            space.append(max_seq_len - n)
    return rows


def collate_packed(rows: list[PackedRow], pad_id: int) -> dict[str, torch.Tensor]:
    """A packed batch: position ids restart at 0 in every document, and a block-diagonal
    causal attention mask (``[batch, 1, T, T]``, True = may attend) keeps documents from
    seeing each other; padding attends only to itself."""
    width = max(len(r.input_ids) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    doc = torch.full((len(rows), width), -1, dtype=torch.long)
    for row, r in enumerate(rows):
        n = len(r.input_ids)
        ids[row, :n] = torch.tensor(r.input_ids)
        labels[row, :n] = torch.tensor(r.labels)
        start = 0
        for d, length in enumerate(r.lengths):
            positions[row, start : start + length] = torch.arange(length)
            doc[row, start : start + length] = d
            start += length
        doc[row, n:] = torch.arange(len(r.lengths), len(r.lengths) + width - n)  # pads: alone
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    mask = (doc[:, :, None] == doc[:, None, :]) & causal
    return {
        "input_ids": ids,
        "labels": labels,
        "position_ids": positions,
        "attention_mask": mask[:, None],
    }
