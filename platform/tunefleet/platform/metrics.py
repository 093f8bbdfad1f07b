"""Prometheus metrics of TuneFleet's services (``GET /metrics`` on the API and on the
controller's health port).

Counters and histograms live in prometheus_client's default registry; with several API
worker processes (``tunefleet api --workers N``) they go through its multiprocess mode
(``PROMETHEUS_MULTIPROC_DIR``, which ``tunefleet api`` sets), so one scrape sums every
worker. Jobs by status and the queue's length are read from the database at scrape time,
so every process answers the same, at most ``JOBS_CACHE_S`` old (several Prometheus
servers, or a fast interval, cost the database one count per few seconds per process).

With ``TUNEFLEET_METRICS_TOKEN`` set, a scrape must send it as a bearer token
(``scrape_allowed``); the chart's ServiceMonitor does.
"""

from __future__ import annotations

import hmac
import os
import threading
import time
from collections.abc import Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from sqlalchemy import func, select
from sqlalchemy.exc import SQLAlchemyError

from tunefleet.platform.db import Job, session_scope
from tunefleet.platform.status import JobStatus

WAITING = (JobStatus.VALIDATING_FILES.value, JobStatus.QUEUED.value)

API_REQUESTS = Counter(
    "tunefleet_api_requests",
    "API requests answered, by route template and status.",
    ["method", "route", "status"],
)
API_SECONDS = Histogram(
    "tunefleet_api_request_seconds",
    "Time from a request to the end of its answer.",
    ["method", "route"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
DISPATCH_WAIT = Histogram(
    "tunefleet_dispatch_wait_seconds",
    "Time a job waited queued before the controller dispatched it.",
    buckets=(0.5, 1, 2, 5, 10, 30, 60, 300, 900, 3600, 4 * 3600, 24 * 3600),
)
PASS_SECONDS = Histogram(
    "tunefleet_controller_pass_seconds",
    "Time of one controller pass (the leader's).",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
)


# How long a count of the jobs by status serves scrapes.
JOBS_CACHE_S = 5.0
_counted: dict[str, tuple[float, dict[str, int]]] = {}  # database URL -> (when, counts)
_counting = threading.Lock()


def scrape_allowed(token: str, authorization: str | None) -> bool:
    """Whether a scrape with this Authorization header may read the metrics: always
    without a token set, else only with ``Bearer <token>`` (compared in constant time)."""
    if not token:
        return True
    return hmac.compare_digest((authorization or "").encode(), f"Bearer {token}".encode())


def _job_counts(db_url: str) -> dict[str, int] | None:
    """Jobs by status, counted at most every ``JOBS_CACHE_S``; None while the database is
    away."""
    with _counting:
        at, counts = _counted.get(db_url, (-JOBS_CACHE_S, {}))
        if time.monotonic() - at < JOBS_CACHE_S:
            return counts
        try:
            with session_scope(db_url) as s:
                rows = s.execute(select(Job.status, func.count()).group_by(Job.status))
                counts = {status: n for status, n in rows}
        except SQLAlchemyError:
            return None
        _counted[db_url] = (time.monotonic(), counts)
        return counts


class JobsCollector:
    """``tunefleet_jobs{status}`` and ``tunefleet_queue_length``, counted in the database
    (``_job_counts``; nothing when it is away: the scrape still answers)."""

    def __init__(self, db_url: str) -> None:
        self.db_url = db_url

    def collect(self) -> Iterator[Metric]:
        counts = _job_counts(self.db_url)
        if counts is None:  # the database away: the other metrics still answer
            return
        jobs = GaugeMetricFamily("tunefleet_jobs", "Jobs by status.", labels=["status"])
        for status in JobStatus:
            jobs.add_metric([status.value], counts.get(status.value, 0))
        yield jobs
        yield GaugeMetricFamily(
            "tunefleet_queue_length",
            "Jobs waiting to run (validating_files or queued).",
            value=sum(counts.get(s, 0) for s in WAITING),
        )


def exposition(db_url: str) -> tuple[bytes, str]:
    """The text a scrape gets, and its content type."""
    base: CollectorRegistry = REGISTRY
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # every worker's counts, summed
        base = CollectorRegistry()
        MultiProcessCollector(base)  # type: ignore[no-untyped-call]
    jobs = CollectorRegistry(auto_describe=False)
    jobs.register(JobsCollector(db_url))
    return generate_latest(base) + generate_latest(jobs), CONTENT_TYPE_LATEST
