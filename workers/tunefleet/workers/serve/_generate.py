"""From token ids to what a client sees: sampling a token, text deltas and stop strings.

The batch engine (``engine.py``) produces each request's token ids; a ``TextStream`` per
request turns them into text deltas as they come, holds back what could be the start of a
stop string or half a character, and says when a stop string ends the answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Sampling:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # OpenAI's penalties on tokens this answer already has: count x frequency + presence
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    logprobs: int | None = None  # None: none; k: the sampled token's and the k likeliest
    grammar: str | None = None  # llguidance grammar every token must follow (structured.py)

    @property
    def adjusts(self) -> bool:
        """Whether the logits change before sampling (else the batch's argmax serves)."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.logit_bias or self.grammar
        )

    @property
    def plain_greedy(self) -> bool:
        """Greedy, with nothing but the argmax read from the logits (no adjustment, no
        log-probabilities): the one case a GPU's logits need not come to the CPU for."""
        greedy = self.temperature == 0 or self.top_p == 0
        return greedy and not self.adjusts and self.logprobs is None


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability under the model (its logits' log-softmax, before
    temperature, penalties or grammar), and the ``top`` likeliest tokens' as (id, logprob)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class Finished:
    """What a decode ends with, after its last text delta."""

    text: str
    finish_reason: str  # "stop" (end of text or a stop string) or "length"
    prompt_tokens: int
    completion_tokens: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # per token of ``text``, when asked


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list | tuple):
            ids.update(int(e) for e in eos)
    return ids


def pick_token(logits: torch.Tensor, sampling: Sampling, gen: torch.Generator | None) -> int:
    """Greedy when ``temperature`` is 0; else temperature and nucleus (``top_p``) sampling,
    reproducible with a seeded generator."""
    if sampling.temperature == 0 or sampling.top_p == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (always the first token)
        keep = sorted_probs.cumsum(-1) - sorted_probs < sampling.top_p
        keep[0] = True  # top_p 0 keeps the likeliest token: greedy
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=gen))


class TextStream:
    """Text of one answer as its tokens arrive."""

    def __init__(self, tokenizer: Any, sampling: Sampling, prompt_tokens: int):
        self.tokenizer = tokenizer
        self.stops = [s for s in sampling.stop if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.prompt_tokens = prompt_tokens
        self.ids: list[int] = []
        self.text, self.sent = "", 0
        self.logprobs: list[TokenLogprob] | None = None if sampling.logprobs is None else []
        self.logprobs_sent = 0

    def push(self, token: int, logprob: TokenLogprob | None = None) -> tuple[str, Finished | None]:
        """The delta now safe to send, and a ``Finished`` when a stop string ended it."""
        self.ids.append(token)
        if self.logprobs is not None and logprob is not None:
            self.logprobs.append(logprob)
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = min((self.text.find(s) for s in self.stops if s in self.text), default=-1)
        if cut >= 0:
            self.text = self.text[:cut]
            if self.logprobs is not None:  # only the tokens of the text kept
                kept = next(
                    (k for k in range(len(self.ids) + 1) if len(self._decode(k)) >= cut),
                    len(self.ids),
                )
                del self.logprobs[kept:]
            return self._rest(), self._finished("stop")
        # hold back a partial character and what could be the start of a stop string
        ready = len(self.text) - (1 if self.text.endswith("\ufffd") else 0) - self.hold
        if ready > self.sent:
            delta, self.sent = self.text[self.sent : ready], ready
            return delta, None
        return "", None

    def _decode(self, count: int) -> str:
        return str(self.tokenizer.decode(self.ids[:count], skip_special_tokens=True))

    def offsets(self, start: int, count: int) -> list[int]:
        """Where each of the first ``count`` tokens begins in the text, from ``start``."""
        return [start + len(self._decode(k)) for k in range(count)]

    def feed(
        self, token: int | None, finish: Any, logprob: TokenLogprob | None = None
    ) -> tuple[str, Finished | None]:
        """One event of the batch engine's sink: a token (with its ``logprob`` when the
        sampling asks for them), or the finish reason (an exception when the batch failed,
        raised here)."""
        if isinstance(finish, BaseException):
            raise finish
        if finish is not None:
            return self.finish(finish)
        assert token is not None
        return self.push(token, logprob)

    def new_logprobs(self) -> list[TokenLogprob] | None:
        """The tokens' log-probabilities since the last call (None when not asked)."""
        if self.logprobs is None:
            return None
        fresh, self.logprobs_sent = self.logprobs[self.logprobs_sent :], len(self.logprobs)
        return fresh

    def finish(self, reason: str) -> tuple[str, Finished]:
        return self._rest(), self._finished(reason)

    def _rest(self) -> str:
        delta, self.sent = self.text[self.sent :], len(self.text)
        return delta

    def _finished(self, reason: str) -> Finished:
        return Finished(
            self.text,
            reason,
            self.prompt_tokens,
            len(self.ids),
            list(self.ids),
            None if self.logprobs is None else list(self.logprobs),
        )
