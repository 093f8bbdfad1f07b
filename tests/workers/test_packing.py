"""Sequence packing: documents packed into one row see only themselves (block-diagonal
attention, positions restarting per document), so each document's logits are the ones it
gets alone; packing fills rows first-fit and ignores each document's first label.

The logits are compared in float64 (``float64.py``): a packed row and a document alone
are different shapes, summed in different orders (float32 differences that depend on
the CPU's kernels); in float64 within ``bound64`` on every CPU."""

from __future__ import annotations

from pathlib import Path

import torch

from float64 import assert_close64, bound64, double, float64
from tunefleet.workers.train.data import IGNORE, Example, collate, collate_packed, pack

TINY = "tiny-llama"


def _examples() -> list[Example]:
    torch.manual_seed(0)
    lengths = [9, 5, 14, 3, 7, 11]
    out = []
    for n in lengths:
        ids = torch.randint(5, 300, (n,)).tolist()
        out.append(Example(ids, [IGNORE, IGNORE, *ids[2:]]))
    return out


def test_pack_first_fit_decreasing() -> None:
    rows = pack(_examples(), max_seq_len=16)
    assert [r.lengths for r in rows] == [[14], [11, 5], [9, 7], [3]]
    for r in rows:
        assert len(r.input_ids) == len(r.labels) == sum(r.lengths) <= 16
        start = 0
        for n in r.lengths:
            assert r.labels[start] == IGNORE
            start += n


def test_packed_logits_equal_alone(tiny_registry: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_registry / TINY, dtype=torch.float32)
    model = double(model.eval())
    examples = _examples()
    rows = pack(examples, max_seq_len=24)
    batch = collate_packed(rows, pad_id=0)
    with torch.no_grad(), float64():
        packed = model(
            input_ids=batch["input_ids"],
            position_ids=batch["position_ids"],
            attention_mask=batch["attention_mask"],
        ).logits
        by_ids = {tuple(e.input_ids): e for e in examples}
        checked = 0
        for row, r in enumerate(rows):
            start = 0
            for n in r.lengths:
                doc = tuple(batch["input_ids"][row, start : start + n].tolist())
                alone = model(**collate([by_ids[doc]], pad_id=0)).logits[0]
                assert_close64(packed[row, start : start + n], alone)
                start += n
                checked += 1
        assert checked == len(examples)
        # without the block-diagonal mask the later documents would see the earlier ones
        leaky = model(input_ids=batch["input_ids"][:1]).logits
    assert rows[0].lengths == [14, 9]
    assert (leaky[0, 14:] - packed[0, 14:23]).abs().max() > 1e3 * bound64(float(packed.abs().max()))
