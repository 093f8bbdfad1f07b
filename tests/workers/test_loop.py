"""The training loop's small pieces that need no Ray: the learning-rate schedule, MFU."""

from __future__ import annotations

import pytest
import torch

from tunefleet.workers.train._loop import linear_schedule


@pytest.mark.parametrize(("warmup", "total"), [(0, 10), (3, 10), (10, 10), (1, 1)])
def test_the_schedule_is_transformers_linear_warmup_and_decay(warmup: int, total: int) -> None:
    from transformers import get_linear_schedule_with_warmup

    def rates(make: object) -> list[float]:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
        scheduler = make(optimizer, warmup, total)  # type: ignore[operator]
        seen = []
        for _ in range(total + 2):  # and past the end: 0, not negative
            seen.append(scheduler.get_last_lr()[0])
            optimizer.step()
            scheduler.step()
        return seen

    ours = rates(linear_schedule)
    assert ours == rates(get_linear_schedule_with_warmup)
    assert max(ours) <= 0.5 and ours[-1] == 0.0


def test_mfu_counts_the_output_layer_at_labelled_positions_only() -> None:
    from tunefleet.workers.train import _metrics as metrics

    # 1,000 tokens of which 100 labelled, 50 FLOPs a token of which 20 the output layer's:
    # 1,000 x 30 + 100 x 20 = 32,000 FLOPs in 2 s against a 32,000 FLOP/s peak
    figures = {"tokens": 1000, "labels": 100, "flops_per_token": 50, "output_layer_flops": 20}
    assert metrics.mfu(**figures, seconds=2.0, peak_flops=32_000) == 0.5
    assert metrics.mfu(**figures, seconds=2.0, peak_flops=0.0) is None  # no known peak
