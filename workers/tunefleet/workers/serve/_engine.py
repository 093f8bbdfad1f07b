"""Continuous batching of decodes for many adapters on one base model.

Requests wait at most ``batch_wait_s`` to be batched with others, are prefilled together
(left-padded), then join the running batch: every decode step runs all active rows —
whatever adapter each uses, the bare base included — through one forward pass with a
shared KV cache. A row leaves the batch when it ends (end-of-text, ``max_tokens``, or its
consumer cancels it, e.g. on a stop string); the rest go on. At most ``max_batch_size``
rows run at once; the others queue.

Each row keeps its own positions (left padding is masked and position ids count only its
real tokens), so a row's tokens are the tokens it would get decoded alone.

The engine runs in one background thread (``start``) or is stepped by hand (``step``),
which is what the tests and the benchmark do.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tunefleet.workers.serve._generate import (
    Finished,
    Sampling,
    TextStream,
    TokenLogprob,
    pick_token,
)
from tunefleet.workers.serve._kvcache import BatchCache
from tunefleet.workers.serve._multilora import MultiLoraModel
from tunefleet.workers.serve._structured import Grammars, fill_masks

# Padding allowed in a prefill group, as a share of its real prompt tokens.
PREFILL_PADDING = 0.15

# sink(token, finish_reason): a token id with None, then once (None, "stop" | "length");
# an exception as finish_reason when the batch failed.
Sink = Callable[[int | None, Any], None]


@dataclass(eq=False)
class Row:
    prompt: list[int]
    sampling: Sampling
    slot: int
    sink: Sink
    ended: bool = False  # finished (stop, length), cancelled or failed: no more tokens
    # decode state
    generated: int = 0
    length: int = 0  # real tokens in the cache = the next position id
    last: int = 0
    gen: torch.Generator | None = field(default=None, repr=False)
    matcher: Any = field(default=None, repr=False)  # the grammar's state (structured.py)
    counts: dict[int, int] = field(default_factory=dict, repr=False)  # for the penalties
    # the sampled tokens' log-probabilities, appended before each token reaches the sink
    logprobs: list[TokenLogprob] = field(default_factory=list, repr=False)

    def cancel(self) -> None:
        """End the row early (its client left, or a stop string ended it)."""
        self.ended = True

    def logprob(self, n: int) -> TokenLogprob | None:
        """The ``n``-th sampled token's log-probability (None when not asked)."""
        return self.logprobs[n] if n < len(self.logprobs) else None


class BatchEngine:
    def __init__(
        self,
        lora: MultiLoraModel,
        eos_ids: set[int],
        *,
        max_batch_size: int = 32,
        batch_wait_s: float = 0.005,
        pad_id: int = 0,
        grammars: Grammars | None = None,
    ):
        self.lora = lora
        self.grammars = grammars
        self.model: Any = lora.model
        self.device = next(self.model.parameters()).device  # the inputs go where it is
        self.eos = eos_ids
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.pad_id = pad_id
        self.pending: queue.Queue[Row] = queue.Queue()
        self.active: list[Row] = []
        self.cache: BatchCache | None = None
        self.mask: torch.Tensor | None = None  # [rows, T] 1 = real token
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # -- submission ------------------------------------------------------------------------
    def submit(self, prompt: list[int], sampling: Sampling, slot: int, sink: Sink) -> Row:
        if not prompt:
            raise ValueError("empty prompt")
        req = Row(list(prompt), sampling, slot, sink)
        if sampling.seed is not None:
            req.gen = torch.Generator().manual_seed(sampling.seed)
        if sampling.grammar is not None and self.grammars is None:
            raise ValueError("this engine has no grammar support")
        self.pending.put(req)
        return req

    @property
    def busy(self) -> bool:
        return bool(self.active) or not self.pending.empty()

    # -- running ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="batch-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 120) -> None:
        """Stop taking work; requests already submitted are finished first."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout)
        while True:  # what raced in after the last step: told, not left waiting
            try:
                req = self.pending.get_nowait()
            except queue.Empty:
                break
            req.sink(None, RuntimeError("this adapter's serving mode changed; retry"))

    def _run(self) -> None:
        while not self._stop.is_set() or self.busy:
            first = None
            if not self.active:
                try:
                    first = self.pending.get(timeout=0.1)
                except queue.Empty:
                    continue
                # a short window so requests arriving together share the prefill
                time.sleep(self.batch_wait_s)
            self.step(first)

    def step(self, first: Row | None = None) -> None:
        """Admit what is waiting (``first``, then the queue, up to the batch size), then one
        decode step for all."""
        new: list[Row] = [first] if first is not None and not first.ended else []
        try:
            self._drop_finished()
            while len(self.active) + len(new) < self.max_batch_size:
                try:
                    req = self.pending.get_nowait()
                except queue.Empty:
                    break
                if not req.ended:
                    new.append(req)
            for r in new:  # in this thread: a matcher compiles its grammar (milliseconds)
                if r.sampling.grammar is not None and r.matcher is None:
                    assert self.grammars is not None
                    r.matcher = self.grammars.matcher(r.sampling.grammar)
            if new:
                self._prefill(new)
            elif self.active:
                self._decode()
            self._drop_finished()
        except Exception as exc:  # fail every request of the batch, keep serving
            for req in {id(r): r for r in [*self.active, *new]}.values():
                if not req.ended:
                    req.ended = True
                    req.sink(None, exc)
            self.active, self.cache, self.mask = [], None, None

    def run_until_idle(self) -> None:
        while self.busy:
            self.step()

    # -- the model -------------------------------------------------------------------------
    def _forward(
        self,
        rows: list[Row],
        ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        cache: BatchCache,
    ) -> torch.Tensor:
        with self.lora.lock, torch.inference_mode():
            self.lora.set_rows([r.slot for r in rows])
            try:
                out = self.model(
                    input_ids=ids,
                    attention_mask=mask,
                    position_ids=positions,
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,  # only the last position's logits are sampled
                )
            finally:
                self.lora.set_rows(None)
        logits: torch.Tensor = out.logits[:, -1, :]
        return logits

    def _prefill(self, new: list[Row]) -> None:
        """Prefill in groups of similar prompt length, so padding stays under
        ``PREFILL_PADDING`` of the tokens computed."""
        group: list[Row] = []
        for req in sorted(new, key=lambda r: len(r.prompt)):
            width = len(req.prompt)  # the longest so far: the list is sorted
            real = sum(len(r.prompt) for r in group) + width
            if group and width * (len(group) + 1) > real * (1 + PREFILL_PADDING):
                self._prefill_group(group)
                group = []
            group.append(req)
        self._prefill_group(group)

    def _prefill_group(self, new: list[Row]) -> None:
        width = max(len(r.prompt) for r in new)
        ids = torch.full((len(new), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(new), width), dtype=torch.long)
        for i, r in enumerate(new):
            ids[i, width - len(r.prompt) :] = torch.tensor(r.prompt)
            mask[i, width - len(r.prompt) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = BatchCache()
        logits = self._forward(new, ids, mask, positions, cache)
        for r in new:
            r.length = len(r.prompt)
        self._join(new, cache, mask)
        self._emit(new, logits)

    def _join(self, new: list[Row], cache: BatchCache, mask: torch.Tensor) -> None:
        """Append prefilled rows to the running batch, left-padding the shorter cache."""
        if self.cache is None or self.mask is None or not self.active:
            self.active, self.cache, self.mask = list(new), cache, mask
            return
        t_old, t_new = self.mask.shape[1], mask.shape[1]
        width = max(t_old, t_new)
        self.cache.join(cache)
        pad = torch.nn.functional.pad
        self.mask = torch.cat([pad(self.mask, (width - t_old, 0)), pad(mask, (width - t_new, 0))])
        self.active.extend(new)

    def _decode(self) -> None:
        assert self.cache is not None and self.mask is not None
        rows = self.active
        ids = torch.tensor([[r.last] for r in rows], device=self.device)
        positions = torch.tensor([[r.length] for r in rows], device=self.device)
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(rows), 1)], dim=1)
        logits = self._forward(rows, ids, self.mask, positions, self.cache)
        for r in rows:
            r.length += 1
        self._emit(rows, logits)

    def _emit(self, rows: list[Row], logits: torch.Tensor) -> None:
        """Sample each live row's next token and hand it to the row's sink. Penalties,
        logit biases and grammars change a row's logits first (grammars for all rows at
        once); log-probabilities are the model's own, before any of that."""
        live = [i for i, r in enumerate(rows) if not r.ended]
        if not live:
            return
        scores = logits.float()
        if any(not rows[i].sampling.plain_greedy for i in live):
            scores = scores.cpu()  # penalties, biases, grammars and sampling: on the CPU
        asked = [i for i in live if rows[i].sampling.logprobs is not None]
        logprobs = torch.log_softmax(scores[asked], -1) if asked else None
        adjusted = [i for i in live if rows[i].sampling.adjusts]
        if adjusted:
            scores = scores.clone()
            for i in adjusted:
                self._adjust(rows[i], scores[i])
            matchers = [(rows[i].matcher, i) for i in adjusted if rows[i].matcher is not None]
            if matchers:
                assert self.grammars is not None
                fill_masks(self.grammars, matchers, scores)
        greedy = scores.argmax(-1).tolist()
        for i in live:
            r = rows[i]
            s = r.sampling
            sampled = s.temperature == 0 or s.top_p == 0
            token = greedy[i] if sampled else pick_token(scores[i], s, r.gen)
            if r.matcher is not None and not r.matcher.consume_token(token):
                r.ended = True
                r.sink(None, RuntimeError(f"grammar: {r.matcher.get_error()}"))
                continue
            if token in self.eos:
                r.ended = True
                r.sink(None, "stop")
                continue
            if logprobs is not None and s.logprobs is not None:
                row = logprobs[asked.index(i)]
                top = row.topk(s.logprobs) if s.logprobs else None
                r.logprobs.append(
                    TokenLogprob(
                        token,
                        float(row[token]),
                        ()
                        if top is None
                        else tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True)),
                    )
                )
            r.generated += 1
            r.last = token
            r.counts[token] = r.counts.get(token, 0) + 1
            r.sink(token, None)
            if r.matcher is not None and r.matcher.is_stopped():
                r.ended = True  # the grammar is complete: nothing may follow
                r.sink(None, "stop")
            elif r.generated >= s.max_tokens:
                r.ended = True
                r.sink(None, "length")

    @staticmethod
    def _adjust(row: Row, scores: torch.Tensor) -> None:
        """OpenAI's logit bias and penalties on one row's logits, in place."""
        s = row.sampling
        if s.logit_bias:
            biased, bias = zip(*s.logit_bias, strict=True)
            scores[list(biased)] += torch.tensor(bias)
        if row.counts and (s.presence_penalty or s.frequency_penalty):
            seen = list(row.counts)
            counts = torch.tensor([row.counts[t] for t in seen], dtype=scores.dtype)
            scores[seen] -= counts * s.frequency_penalty + s.presence_penalty

    def _drop_finished(self) -> None:
        """Remove ended rows from the batch and the cache, and trim padding columns."""
        if not any(r.ended for r in self.active):
            return
        keep = [i for i, r in enumerate(self.active) if not r.ended]
        self.active = [self.active[i] for i in keep]
        if not keep or self.cache is None or self.mask is None:
            self.active, self.cache, self.mask = [], None, None
            return
        index = torch.tensor(keep, device=self.device)
        self.mask = self.mask.index_select(0, index)
        # columns that are padding in every remaining row
        first_real = int((self.mask.cumsum(-1) == 0).sum(-1).min())
        self.mask = self.mask[:, first_real:]
        self.cache.select(index, first_real)


def generate_all(
    engine: BatchEngine, tokenizer: Any, items: list[tuple[list[int], Sampling, int]]
) -> list[Finished]:
    """Decode ``(prompt, sampling, slot)`` items together by stepping the engine in this
    thread (tests and benchmarks; the server runs the engine in its own thread)."""
    done: list[Finished | None] = [None] * len(items)
    streams = [TextStream(tokenizer, s, len(p)) for p, s, _ in items]

    def sink_for(i: int) -> Sink:
        def sink(token: int | None, finish: Any) -> None:
            stream = streams[i]
            _, end = stream.feed(token, finish, requests[i].logprob(len(stream.ids)))
            if end is not None:
                done[i] = end
                requests[i].cancel()  # a stop string ended it; no-op once the row ended

        return sink

    requests = [engine.submit(p, s, slot, sink_for(i)) for i, (p, s, slot) in enumerate(items)]
    engine.run_until_idle()
    assert all(d is not None for d in done)
    return [d for d in done if d is not None]
