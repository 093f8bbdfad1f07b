"""The loop's loss runs the output layer only at labelled positions (``loss.py``): it must
be the model's own loss, with the model's own gradients, for every kind of batch and for
methods that change the sequence (prompt tuning's virtual tokens) or the model (full); the
token accuracy from the same logits must be the share of label tokens argmax predicts.

The loss and its gradients are compared in float64 (``float64.py``): the two routes sum
in different orders (the output layer over the labelled rows or over every row, the
mean over the labels or over every position), and in float32 by how much depends on the
CPU's kernels; in float64 within ``bound64`` on every CPU."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from float64 import assert_close64, double, float64
from tunefleet.platform.spec import JobSpec
from tunefleet.workers.train._loss import LabelledLogits, correct_tokens, mean_loss
from tunefleet.workers.train._methods import build_model
from tunefleet.workers.train.data import IGNORE, Example, collate, collate_packed, pack


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tinyllm import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("loss") / "tiny")


def _model(path: Path, method: str) -> Any:
    """The training loop's model for ``method``, in float64."""
    spec = JobSpec.model_validate(
        {
            "job_id": "ftjob-loss",
            "tenant_id": "t",
            "model": "tiny",
            "training_file": "file-1",
            "hyperparameters": {"n_epochs": 1, "batch_size": 1, "learning_rate_multiplier": 1},
            "seed": 0,
            "tunefleet": {"method": method, "lora": {"dropout": 0.0}},
        }
    )
    return double(build_model(spec, str(path)).model)


def _examples() -> list[Example]:
    """Prompts (no labels) of several lengths followed by answers; one answer is empty
    after the first token, one example is all answer."""
    torch.manual_seed(1)
    out = []
    for prompt, answer in [(6, 4), (3, 9), (10, 1), (0, 7)]:
        ids = torch.randint(5, 300, (prompt + answer,)).tolist()
        out.append(Example(ids, [IGNORE] * prompt + ids[prompt:]))
    return out


def _grads(model: Any) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize(
    ("method", "packed"),
    [("lora", False), ("lora", True), ("full", True), ("prompt_tuning", False)],
)  # prompt tuning refuses packing (spec.py)
def test_the_loss_is_the_models_own(tiny: Path, method: str, packed: bool) -> None:
    model = _model(tiny, method)
    labelled = LabelledLogits(model.get_output_embeddings())
    examples = _examples()
    batch = collate_packed(pack(examples, 24), 0) if packed else collate(examples, 0)

    with float64():
        own = model(**batch).loss
        own.backward()
        expected = _grads(model)

        logits, targets = labelled(model, batch)
        n_labels = int((batch["labels"][:, 1:] != IGNORE).sum())
        if method == "prompt_tuning":  # the last virtual token predicts the first input token
            n_labels += int((batch["labels"][:, 0] != IGNORE).sum())
        assert logits.shape == (n_labels, model.config.vocab_size) and targets.shape == (n_labels,)
        loss = mean_loss(logits, targets)
        loss.backward()
        assert_close64(loss, own)
        got = _grads(model)
        assert got.keys() == expected.keys() and got
        for name, grad in got.items():
            assert_close64(grad, expected[name], msg=name)

        # outside a call the output layer is untouched: every position's logits
        assert model(**batch).logits.shape[:2][0] == batch["input_ids"].shape[0]


class _Logits(torch.nn.Module):
    """A "model" whose output layer (an identity) gets given logits as its hidden states."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.logits, self.head = logits, torch.nn.Identity()

    def forward(self, **_: Any) -> Any:
        return SimpleNamespace(logits=self.head(self.logits))


def test_the_token_accuracy_is_the_argmax_share_of_label_tokens() -> None:
    torch.manual_seed(0)
    vocab = 11
    labels = torch.randint(0, vocab, (3, 9))
    labels[0, :4] = labels[1, 6:] = labels[2, ::3] = IGNORE  # prompts, padding, gaps
    logits = torch.randn(3, 9, vocab)
    # about half the predictions right, so the share is far from 0 and 1
    right = (torch.rand(3, 8) < 0.5) & (labels[:, 1:] != IGNORE)
    b, t = right.nonzero(as_tuple=True)
    logits[b, t, labels[b, t + 1]] += 10.0
    logits.requires_grad_()  # as in training: the count carries no gradient

    model = _Logits(logits)
    picked, targets = LabelledLogits(model.head)(model, {"input_ids": labels, "labels": labels})
    correct = correct_tokens(picked, targets)

    # directly: position t predicts token t+1, where that token has a label
    gold = labels[:, 1:]
    keep = gold != IGNORE
    direct = logits[:, :-1].argmax(-1)[keep] == gold[keep]
    assert len(targets) == int(keep.sum())
    assert int(correct) == int(direct.sum()) >= int(right.sum()) > 0
    # in float64 the mean is the one rounding Python's division makes, whatever the count
    assert float(correct) / len(targets) == float(direct.double().mean())
    assert not correct.requires_grad and correct.dtype == torch.int64
