"""The planner against real training steps on the CPU (the training loop's own model,
optimizer and precision, for every method): parameter + gradient + optimizer bytes within 5%
of what is allocated, total peak within 25% of the measured peak."""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from planner_accuracy import compare

pytestmark = pytest.mark.slow

CASES = [
    {"method": "lora", "targets": ["q_proj", "v_proj"], "batch": 4, "seq": 256, "ckpt": False},
    {"method": "lora", "targets": ["all-linear"], "batch": 4, "seq": 256, "ckpt": False},
    {"method": "lora", "targets": ["all-linear"], "batch": 4, "seq": 256, "ckpt": True},
    {"method": "full", "targets": [], "batch": 2, "seq": 256, "ckpt": False},
    {"method": "full", "targets": [], "batch": 2, "seq": 256, "ckpt": False, "precision": "bf16"},
    {
        "method": "lora",
        "targets": ["all-linear"],
        "batch": 4,
        "seq": 256,
        "ckpt": False,
        "precision": "bf16",
    },
    {"method": "qlora", "targets": ["all-linear"], "batch": 4, "seq": 256, "ckpt": False},
    *(
        {"method": m, "targets": [], "batch": 4, "seq": 256, "ckpt": False}
        for m in ("ia3", "prefix_tuning", "prompt_tuning", "adapter")
    ),
    {"method": "bitfit", "targets": [], "batch": 4, "seq": 256, "ckpt": False, "bias": True},
]


@pytest.fixture(scope="module")
def measured() -> dict[str, dict[str, Any]]:
    """Every case measured once for the module, in two processes at once of one compute
    thread each: each imports the libraries once and measures each of its cases in a child
    of its own, so every case measures only its own memory."""
    halves = [CASES[0::2], CASES[1::2]]
    with ThreadPoolExecutor(2) as pool:
        rows = [
            r for half in pool.map(lambda cases: compare(cases, threads=1), halves) for r in half
        ]
    return {json.dumps(r["case"], sort_keys=True): r for r in rows}


def row(measured: dict[str, dict[str, Any]], case: dict[str, Any]) -> dict[str, Any]:
    return measured[json.dumps(case, sort_keys=True)]


@pytest.mark.parametrize(
    "case",
    CASES,
    ids=lambda c: (
        f"{c['method']}{'-all' if c['targets'] == ['all-linear'] else ''}"
        f"-ckpt{c['ckpt']}-{c.get('precision', 'fp32')}"
    ),
)
def test_prediction_matches_a_real_step(
    measured: dict[str, dict[str, Any]], case: dict[str, Any]
) -> None:
    got = row(measured, case)
    assert got["predicted"]["trainable"] == got["measured"]["trainable"]
    assert got["predicted"]["total"] == got["measured"]["total"]
    assert abs(got["states_error"]) <= 0.05, got
    assert abs(got["peak_error"]) <= 0.25, got


def test_checkpointing_lowers_the_measured_peak(measured: dict[str, dict[str, Any]]) -> None:
    plain, ckpt = row(measured, CASES[1]), row(measured, CASES[2])
    assert ckpt["measured"]["peak_bytes"] < 0.7 * plain["measured"]["peak_bytes"]
    assert ckpt["predicted"]["peak_bytes"] < 0.7 * plain["predicted"]["peak_bytes"]
