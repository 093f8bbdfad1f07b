"""The planner against real training steps on the CPU (the training loop's own model,
optimizer and precision, for every method): parameter + gradient + optimizer bytes within 5%
of what is allocated, total peak within 25% of the measured peak."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from planner_accuracy import compare

pytestmark = pytest.mark.slow

CASES = [
    {"method": "lora", "targets": ["q_proj", "v_proj"], "batch": 4, "seq": 256, "ckpt": False},
    {"method": "lora", "targets": ["all-linear"], "batch": 4, "seq": 256, "ckpt": True},
    {"method": "full", "targets": [], "batch": 2, "seq": 256, "ckpt": False},
    {"method": "full", "targets": [], "batch": 2, "seq": 256, "ckpt": False, "precision": "bf16"},
    {"method": "qlora", "targets": ["all-linear"], "batch": 4, "seq": 256, "ckpt": False},
    *(
        {"method": m, "targets": [], "batch": 4, "seq": 256, "ckpt": False}
        for m in ("ia3", "prefix_tuning", "prompt_tuning", "adapter")
    ),
    {"method": "bitfit", "targets": [], "batch": 4, "seq": 256, "ckpt": False, "bias": True},
]


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"{c['method']}-ckpt{c['ckpt']}-{c.get('precision', 'fp32')}"
)
def test_prediction_matches_a_real_step(case: dict[str, object]) -> None:
    row = compare(case)
    assert row["predicted"]["trainable"] == row["measured"]["trainable"]
    assert row["predicted"]["total"] == row["measured"]["total"]
    assert abs(row["states_error"]) <= 0.05, row
    assert abs(row["peak_error"]) <= 0.25, row


def test_checkpointing_lowers_the_measured_peak() -> None:
    plain = compare({**CASES[1], "ckpt": False})
    ckpt = compare(CASES[1])
    assert ckpt["measured"]["peak_bytes"] < 0.7 * plain["measured"]["peak_bytes"]
    assert ckpt["predicted"]["peak_bytes"] < 0.7 * plain["predicted"]["peak_bytes"]
