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

from tunefleet.workers.serve.generate import Finished, Sampling, TextStream, pick_token
from tunefleet.workers.serve.kvcache import BatchCache
from tunefleet.workers.serve.multilora import MultiLoraModel

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

    def cancel(self) -> None:
        """End the row early (its client left, or a stop string ended it)."""
        self.ended = True


class BatchEngine:
    def __init__(
        self,
        lora: MultiLoraModel,
        eos_ids: set[int],
        *,
        max_batch_size: int = 32,
        batch_wait_s: float = 0.005,
        pad_id: int = 0,
    ):
        self.lora = lora
        self.model: Any = lora.model
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
        ids = torch.tensor([[r.last] for r in rows])
        positions = torch.tensor([[r.length] for r in rows])
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(rows), 1)], dim=1)
        logits = self._forward(rows, ids, self.mask, positions, self.cache)
        for r in rows:
            r.length += 1
        self._emit(rows, logits)

    def _emit(self, rows: list[Row], logits: torch.Tensor) -> None:
        greedy = logits.argmax(-1).tolist()
        for i, r in enumerate(rows):
            if r.ended:
                continue
            s = r.sampling
            token = greedy[i] if s.temperature == 0 else pick_token(logits[i], s, r.gen)
            if token in self.eos:
                r.ended = True
                r.sink(None, "stop")
                continue
            r.generated += 1
            r.last = token
            r.sink(token, None)
            if r.generated >= s.max_tokens:
                r.ended = True
                r.sink(None, "length")

    def _drop_finished(self) -> None:
        """Remove ended rows from the batch and the cache, and trim padding columns."""
        if not any(r.ended for r in self.active):
            return
        keep = [i for i, r in enumerate(self.active) if not r.ended]
        self.active = [self.active[i] for i in keep]
        if not keep or self.cache is None or self.mask is None:
            self.active, self.cache, self.mask = [], None, None
            return
        index = torch.tensor(keep)
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
            _, end = streams[i].feed(token, finish)
            if end is not None:
                done[i] = end
                requests[i].cancel()  # a stop string ended it; no-op once the row ended

        return sink

    requests = [engine.submit(p, s, slot, sink_for(i)) for i, (p, s, slot) in enumerate(items)]
    engine.run_until_idle()
    assert all(d is not None for d in done)
    return [d for d in done if d is not None]
