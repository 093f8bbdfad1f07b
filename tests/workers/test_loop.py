"""The training loop's small pieces that need no Ray: the learning-rate schedule."""

from __future__ import annotations

import pytest
import torch

from tunefleet.workers.train.loop import linear_schedule


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
