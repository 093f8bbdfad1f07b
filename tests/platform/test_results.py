"""A succeeded job's results file (``results.step_metrics_csv``): OpenAI's columns, a row
per step from the metrics events, empty cells where a step has no value."""

from __future__ import annotations

import csv
import io

from tunefleet.platform.results import step_metrics_csv


def test_a_row_per_step_with_openais_columns() -> None:
    events = [
        {"step": 1, "total_steps": 3, "train_loss": 2.5, "train_mean_token_accuracy": 0.25},
        {
            "step": 2,
            "train_loss": 1.75,
            "train_mean_token_accuracy": 0.5,
            "valid_loss": 1.9,
            "valid_mean_token_accuracy": 0.375,
            "full_valid_loss": 1.9,
        },
        {"step": 3, "train_loss": 1.0, "train_mean_token_accuracy": None},  # no label token
    ]
    assert step_metrics_csv(events).decode() == (
        "step,train_loss,train_accuracy,valid_loss,valid_mean_token_accuracy\n"
        "1,2.5,0.25,,\n"
        "2,1.75,0.5,1.9,0.375\n"
        "3,1.0,,,\n"
    )


def test_a_step_trained_again_after_a_resume_keeps_its_last_record() -> None:
    """A run killed after reporting step 3 resumes from its step-2 checkpoint and reports
    step 3 again: one row, the second run's."""
    events = [
        {"step": 1, "train_loss": 3.0},
        {"step": 2, "train_loss": 2.0},
        {"step": 3, "train_loss": 1.5},
        {"step": 3, "train_loss": 1.25},
        {"step": 4, "train_loss": float("nan")},  # not finite: no value
    ]
    rows = list(csv.DictReader(io.StringIO(step_metrics_csv(events).decode())))
    assert [(r["step"], r["train_loss"]) for r in rows] == [
        ("1", "3.0"),
        ("2", "2.0"),
        ("3", "1.25"),
        ("4", ""),
    ]


def test_no_metrics_is_a_header_alone() -> None:
    assert step_metrics_csv([]) == (
        b"step,train_loss,train_accuracy,valid_loss,valid_mean_token_accuracy\n"
    )
