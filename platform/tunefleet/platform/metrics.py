"""Prometheus metrics of TuneFleet's services (``GET /metrics`` on the API and on the
controller's health port).

Counters and histograms live in prometheus_client's default registry; with several API
worker processes (``tunefleet api --workers N``) they go through its multiprocess mode
(``PROMETHEUS_MULTIPROC_DIR``, which ``tunefleet api`` sets), so one scrape sums every
worker. Jobs by status and the queue's length are read from the database at scrape time,
so every process answers the same.
"""

from __future__ import annotations

import os
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


class JobsCollector:
    """``tunefleet_jobs{status}`` and ``tunefleet_queue_length``, counted in the database
    when scraped (nothing when it is away: the scrape still answers)."""

    def __init__(self, db_url: str) -> None:
        self.db_url = db_url

    def collect(self) -> Iterator[Metric]:
        try:
            with session_scope(self.db_url) as s:
                rows = s.execute(select(Job.status, func.count()).group_by(Job.status))
                counts = {status: n for status, n in rows}
        except SQLAlchemyError:  # the database away: the other metrics still answer
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
