"""How adapters are being served, from the metrics Serve replicas export per adapter
(``workers/serve/_metrics.py``) through Ray's metrics agent on each node (Prometheus text on
the node's metrics export port, names prefixed ``ray_``, counters suffixed ``_total``):
requests, generated tokens, latency, and the replicas whose cache holds each adapter
(loads minus evictions). Read over HTTP, like the cluster view; a node that does not
answer is named in ``UsageView.errors``, never an exception."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tunefleet.api.ui._cluster import TIMEOUT_S, ClusterView


@dataclass
class AdapterUsage:
    requests: float = 0
    tokens: float = 0
    seconds: float = 0  # summed request latency
    buckets: dict[float, float] = field(default_factory=dict)  # le -> cumulative count
    replicas: set[str] = field(default_factory=set)  # where its cache holds it now

    @property
    def mean_latency(self) -> float | None:
        return self.seconds / self.requests if self.requests else None

    @property
    def p95_latency(self) -> float | None:
        return quantile(self.buckets, 0.95)


@dataclass
class UsageView:
    adapters: dict[str, AdapterUsage] = field(default_factory=dict)  # by adapter id
    errors: list[str] = field(default_factory=list)
    nodes: int = 0  # nodes read


def quantile(buckets: dict[float, float], q: float) -> float | None:
    """The ``q`` quantile of a Prometheus histogram's cumulative ``buckets``, interpolated
    within its bucket (as PromQL's ``histogram_quantile``); the top finite bound when it
    falls in the +Inf bucket."""
    if not buckets:
        return None
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank, low, below = q * total, 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return low
            inside = count - below
            return low + (bound - low) * ((rank - below) / inside if inside else 1.0)
        low, below = bound, count
    return low


def parse(text: str, into: dict[str, AdapterUsage]) -> None:
    """Add one node's metrics ``text`` to ``into``."""
    loads: dict[tuple[str, str], float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        name = family.name.removeprefix("ray_")
        if not name.startswith("tunefleet_adapter_"):
            continue
        for sample in family.samples:
            adapter = sample.labels.get("adapter")
            if not adapter:
                continue
            usage = into.setdefault(adapter, AdapterUsage())
            replica = sample.labels.get("replica", "?")  # Serve tags each replica's metrics
            if name == "tunefleet_adapter_requests" and sample.name.endswith("_total"):
                usage.requests += sample.value
            elif name == "tunefleet_adapter_generated_tokens" and sample.name.endswith("_total"):
                usage.tokens += sample.value
            elif name == "tunefleet_adapter_request_seconds":
                if sample.name.endswith("_sum"):
                    usage.seconds += sample.value
                elif sample.name.endswith("_bucket"):
                    le = float(sample.labels["le"])
                    usage.buckets[le] = usage.buckets.get(le, 0.0) + sample.value
            elif name == "tunefleet_adapter_loads" and sample.name.endswith("_total"):
                loads[(adapter, replica)] += sample.value
            elif name == "tunefleet_adapter_evictions" and sample.name.endswith("_total"):
                loads[(adapter, replica)] -= sample.value
    for (adapter, replica), held in loads.items():
        if held > 0:
            into[adapter].replicas.add(replica)


def fetch_usage(
    cluster: ClusterView, default_port: int | None, *, timeout: float = TIMEOUT_S
) -> UsageView:
    """Every alive node's adapter metrics, summed."""
    view = UsageView()
    if cluster.error:
        view.errors.append(cluster.error)
    for node in cluster.nodes:
        port = node.metrics_port or default_port
        if not node.alive or not node.ip or not port:
            continue
        url = f"http://{node.ip}:{port}/metrics"
        try:
            resp = httpx.get(url, timeout=timeout)
            resp.raise_for_status()
            parse(resp.text, view.adapters)
        except (httpx.HTTPError, ValueError) as exc:
            view.errors.append(f"metrics of node {node.host} at {url}: {type(exc).__name__}")
            continue
        view.nodes += 1
    return view
