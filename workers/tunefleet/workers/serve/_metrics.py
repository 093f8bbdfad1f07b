"""A replica's per-adapter metrics, through Ray's metrics agent (Prometheus on each
node's metrics export port; Serve adds the deployment, replica and application tags, Ray
prefixes the names with ``ray_``). ``adapter`` is the adapter id, or ``base``."""

from __future__ import annotations

import time

from tunefleet.workers.serve._generate import Finished

LATENCY_BOUNDARIES = [0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]


class AdapterMetrics:
    def __init__(self) -> None:
        from ray.serve import metrics  # in the replica, where Ray runs

        per_adapter = ("adapter",)
        self.requests = metrics.Counter(
            "tunefleet_adapter_requests", "Requests per adapter.", tag_keys=per_adapter
        )
        self.tokens = metrics.Counter(
            "tunefleet_adapter_generated_tokens", "Tokens generated.", tag_keys=per_adapter
        )
        self.latency = metrics.Histogram(
            "tunefleet_adapter_request_seconds",
            "Time from request to last token.",
            boundaries=LATENCY_BOUNDARIES,
            tag_keys=per_adapter,
        )
        self.loads = metrics.Counter(
            "tunefleet_adapter_loads", "Adapters loaded into this replica.", tag_keys=per_adapter
        )
        self.evictions = metrics.Counter(
            "tunefleet_adapter_evictions", "Adapters evicted (LRU).", tag_keys=per_adapter
        )

    def loaded(self, adapter_id: str) -> None:
        self.loads.inc(tags={"adapter": adapter_id})

    def evicted(self, adapter_id: str) -> None:
        self.evictions.inc(tags={"adapter": adapter_id})

    def answered(self, adapter_id: str, done: list[Finished], started: float) -> None:
        """One request answered: its tokens, and its time since ``started`` (a
        ``time.perf_counter()``)."""
        tags = {"adapter": adapter_id or "base"}
        self.requests.inc(tags=tags)
        tokens = sum(f.completion_tokens for f in done)
        if tokens:
            self.tokens.inc(tokens, tags=tags)
        self.latency.observe(time.perf_counter() - started, tags=tags)
