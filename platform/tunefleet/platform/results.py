"""A succeeded job's results file: OpenAI's ``step_metrics.csv``, one row per step.

The controller writes it from the job's metrics events when the job succeeds, stores it as
a file of the job's tenant (purpose ``fine-tune-results``) and names it in the job's
``result_files``; the files API lists and serves it like an upload.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterable, Mapping
from typing import Any

PURPOSE = "fine-tune-results"
FILENAME = "step_metrics.csv"
FORMAT = "csv"

# the file's columns (OpenAI's), each with the metrics event field it is read from
COLUMNS = {
    "step": "step",
    "train_loss": "train_loss",
    "train_accuracy": "train_mean_token_accuracy",
    "valid_loss": "valid_loss",
    "valid_mean_token_accuracy": "valid_mean_token_accuracy",
}


def step_metrics_csv(events: Iterable[Mapping[str, Any]]) -> bytes:
    """The CSV of metrics events' ``data``, given in the order they were recorded: a header
    of ``COLUMNS``, then a row per step in step order. A step recorded more than once (a
    run that resumed from a checkpoint older than its last reports trains the steps after
    it again) keeps its last record. A cell is empty where the event has no number for it
    (no validation file, no accuracy, a loss that was not finite)."""
    steps: dict[int, Mapping[str, Any]] = {}
    for data in events:
        step = data.get("step")
        if isinstance(step, int) and not isinstance(step, bool):
            steps[step] = data
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(COLUMNS)
    for step in sorted(steps):
        writer.writerow(_cell(steps[step].get(field)) for field in COLUMNS.values())
    return out.getvalue().encode()


def _cell(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return ""
    if isinstance(value, float) and not math.isfinite(value):
        return ""
    return str(value)
