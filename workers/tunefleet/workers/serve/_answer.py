"""One request's answer: its rows decoded in a replica's shared batch, turned into text
as the tokens come."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from tunefleet.workers.serve._engine import BatchEngine
from tunefleet.workers.serve._generate import Finished, Sampling, TextStream, TokenLogprob


class Answer:
    """The choices of one request, decoded in the shared batch; iterate for
    ``(choice index, text delta, its tokens' logprobs or None, Finished | None)`` as they
    come. Leaving early (a client
    that disconnects) cancels the rows; the adapter is released at the end either way."""

    def __init__(
        self,
        server: Any,
        engine: BatchEngine,
        slot: int,
        adapter_id: str,
        choices: list[tuple[list[int], Sampling]],
    ):
        self.server, self.engine, self.slot, self.adapter_id = server, engine, slot, adapter_id
        self.choices = choices
        self.done: list[Finished] = []

    async def __aiter__(
        self,
    ) -> AsyncIterator[tuple[int, str, list[TokenLogprob] | None, Finished | None]]:
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        streams = [TextStream(self.server.tokenizer, s, len(p)) for p, s in self.choices]
        finished: list[Finished | None] = [None] * len(self.choices)
        rows = []
        try:  # rows submitted before a failing one are cancelled, the adapter released
            for i, (p, s) in enumerate(self.choices):
                rows.append(self.engine.submit(p, s, self.slot, _sink(loop, queue, i)))
            while any(f is None for f in finished):
                i, token, finish = await queue.get()
                if finished[i] is not None:
                    continue
                stream = streams[i]
                delta, end = stream.feed(token, finish, rows[i].logprob(len(stream.ids)))
                if end is not None:
                    rows[i].cancel()  # a stop string ended it; no-op once the row ended
                finished[i] = end
                logprobs = stream.new_logprobs() if delta or end is not None else None
                yield i, delta, logprobs, end
            self.done = [f for f in finished if f is not None]
            self.server.metrics.answered(self.adapter_id, self.done, started)
        finally:
            for row in rows:
                row.cancel()
            if self.slot:
                self.server.cache.release(self.adapter_id)


def _sink(loop: asyncio.AbstractEventLoop, out: asyncio.Queue[Any], index: int) -> Any:
    """An engine sink that hands (choice index, token, finish) to the request's event loop."""
    return lambda token, finish: loop.call_soon_threadsafe(out.put_nowait, (index, token, finish))
