"""Decoding one request on a shared model: token by token with a KV cache, so the serving
app can stream text as it is made and stop on the client's stop strings.

The model is shared by every request of a replica (and adapters load into it), so each
forward step takes the replica's lock, not the whole request: concurrent streams
interleave step by step instead of queueing behind each other.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

BASE = "__base__"  # peft's name for "no adapter" in a mixed batch


@dataclass(frozen=True)
class Sampling:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass
class Finished:
    """What a decode ends with, after its last text delta."""

    text: str
    finish_reason: str  # "stop" (end of text or a stop string) or "length"
    prompt_tokens: int
    completion_tokens: int
    token_ids: list[int] = field(default_factory=list)


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list | tuple):
            ids.update(int(e) for e in eos)
    return ids


def _pick(logits: torch.Tensor, sampling: Sampling, gen: torch.Generator | None) -> int:
    if sampling.temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (always the first token)
        keep = sorted_probs.cumsum(-1) - sorted_probs < sampling.top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=gen))


def decode(
    model: Any,
    tokenizer: Any,
    input_ids: list[int],
    sampling: Sampling,
    *,
    adapter_id: str = "",
    lock: threading.Lock | None = None,
) -> Iterator[str | Finished]:
    """Yield text deltas as tokens are decoded, then one ``Finished``. Greedy when
    ``temperature`` is 0; sampled with ``seed`` reproducibly otherwise."""
    lock = lock or threading.Lock()
    gen = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
    eos = _eos_ids(model, tokenizer)
    hold = max((len(s) for s in sampling.stop), default=1) - 1
    ids = torch.tensor([input_ids])
    past: Any = None
    out_ids: list[int] = []
    text, sent, finish = "", 0, "length"
    while len(out_ids) < sampling.max_tokens:
        with lock, torch.inference_mode():
            kwargs: dict[str, Any] = {"past_key_values": past, "use_cache": True}
            if hasattr(model, "peft_config"):
                kwargs["adapter_names"] = [adapter_id or BASE]
            out = model(input_ids=ids, **kwargs)
        past = out.past_key_values
        token = _pick(out.logits[0, -1], sampling, gen)
        if token in eos:
            finish = "stop"
            break
        out_ids.append(token)
        ids = torch.tensor([[token]])
        text = tokenizer.decode(out_ids, skip_special_tokens=True)
        cut = min((text.find(s) for s in sampling.stop if s and s in text), default=-1)
        if cut >= 0:
            text, finish = text[:cut], "stop"
            break
        # hold back a partial character and what could be the start of a stop string
        ready = len(text) - (1 if text.endswith("\ufffd") else 0) - hold
        if ready > sent:
            yield text[sent:ready]
            sent = ready
    if len(text) > sent:
        yield text[sent:]
    yield Finished(text, finish, len(input_ids), len(out_ids), out_ids)


def complete(
    model: Any,
    tokenizer: Any,
    input_ids: list[int],
    sampling: Sampling,
    *,
    adapter_id: str = "",
    lock: threading.Lock | None = None,
) -> Finished:
    """The whole decode at once."""
    for item in decode(model, tokenizer, input_ids, sampling, adapter_id=adapter_id, lock=lock):
        if isinstance(item, Finished):
            return item
    raise AssertionError("decode ends with Finished")
