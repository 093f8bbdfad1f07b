"""The micro-batch search of the seeds' Step 2 (``probe.search``), against a device whose
limit the test knows; the real device runs are in test_training.py."""

from __future__ import annotations

import pytest

from tunefleet.workers.train._probe import NoMicroBatchFits, search


def _device(limit: int) -> tuple[list[int], object]:
    tried: list[int] = []

    def fits(size: int) -> bool:
        tried.append(size)
        return size <= limit

    return tried, fits


@pytest.mark.parametrize(
    ("limit", "start", "most", "chosen", "tried"),
    [
        (64, 4, 32, 32, [4, 8, 16, 32]),  # the plan was cautious: double up to the share
        (12, 4, 32, 8, [4, 8, 16]),  # stop at the last size that fit
        (5, 16, 32, 4, [16, 8, 4]),  # the plan was too large: halve until one runs
        (3, 4, 4, 2, [4, 2]),
        (100, 8, 8, 8, [8]),  # the plan is the share and fits: one attempt
    ],
)
def test_search_finds_the_largest_size_that_runs(
    limit: int, start: int, most: int, chosen: int, tried: list[int]
) -> None:
    attempts, fits = _device(limit)
    size, failed = search(fits, start, most)  # type: ignore[arg-type]
    assert size == chosen and attempts == tried
    assert failed == [s for s in tried if s > limit]


def test_nothing_fits_says_what_to_change() -> None:
    _, fits = _device(0)
    with pytest.raises(NoMicroBatchFits, match=r"max_seq_len.*gradient_checkpointing"):
        search(fits, 4, 8)  # type: ignore[arg-type]
