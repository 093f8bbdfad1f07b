"""DPO's pieces on a tiny random Llama, against plain reference computations: the
sequence log-probabilities the loss uses, from one row per pair that holds the shared
prompt once, are the full model's for each sequence alone, over the answer's tokens only,
with the model's gradients; the loss is the paper's formula; the reference with the
adapter switched off is the base model; and a preference line tokenizes into two
sequences labelled on their answers.

The tests that compare two computations of the same numbers run the model in float64
(``float64.py``): in float32 their difference is rounding that depends on the CPU's
kernels (the gradient test once failed on an AVX2 EPYC by 2.3e-5 against 1e-5); in
float64 it is bounded from the unit roundoff (``bound64``: 3.3e-9 for these
gradients, 5.9e-9 for these log-probabilities), on every CPU, while a prompt token counted
in an answer, a wrong mask or a wrong position moves them by 0.89 or more."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from float64 import assert_close64, bound64, double, float64
from tunefleet.platform.spec import JobSpec
from tunefleet.workers.train._dpo import (
    Reference,
    collate_pairs,
    dpo_loss,
    sequence_logps,
)
from tunefleet.workers.train._loss import LabelledLogits
from tunefleet.workers.train._methods import build_model
from tunefleet.workers.train.data import (
    IGNORE,
    Example,
    PreferencePair,
    collate,
    load_dataset,
    token_stats,
    tokenize_example,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tinyllm import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("dpo") / "tiny")


@pytest.fixture(scope="module")
def tokenizer(tiny: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny)


def _built(path: Path, method: str) -> Any:
    """The training loop's model for ``method``, in float64 (``float64.double``)."""
    spec = JobSpec.model_validate(
        {
            "job_id": "ftjob-dpo",
            "tenant_id": "t",
            "model": "tiny",
            "training_file": "file-1",
            "hyperparameters": {"n_epochs": 1, "batch_size": 1, "learning_rate_multiplier": 1},
            "seed": 0,
            "tunefleet": {"method": method, "lora": {"dropout": 0.0}},
            "objective": "dpo",
            "dpo": {"beta": 0.1, "reference": "adapter_disabled"},
        }
    )
    built = build_model(spec, str(path))
    double(built.model)
    return built


def _pairs() -> list[PreferencePair]:
    """Pairs sharing a prompt of several lengths, with answers of different lengths."""
    torch.manual_seed(2)
    out = []
    for prompt, chosen, rejected in [(5, 3, 6), (2, 7, 2), (8, 1, 4)]:
        head = torch.randint(5, 300, (prompt,)).tolist()
        a = torch.randint(5, 300, (chosen,)).tolist()
        b = torch.randint(5, 300, (rejected,)).tolist()
        out.append(
            PreferencePair(
                Example(head + a, [IGNORE] * prompt + a),
                Example(head + b, [IGNORE] * prompt + b),
            )
        )
    return out


def _plain_logps(model: Any, example: Example) -> torch.Tensor:
    """log pi(answer | prompt) from the model's every-position logits."""
    ids = torch.tensor([example.input_ids])
    logp = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
    labels = torch.tensor(example.labels[1:])
    keep = labels != IGNORE
    return logp[keep].gather(-1, labels[keep, None]).sum()


def test_sequence_logps_are_the_answers_log_probabilities_with_the_models_gradients(
    tiny: Path,
) -> None:
    model = _built(tiny, "full").model
    labelled = LabelledLogits(model.get_output_embeddings())
    pairs = _pairs()
    batch, computed = collate_pairs(pairs, 0)
    rows = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    # one row per pair, the prompt in it once
    assert batch["input_ids"].shape[0] == len(pairs)
    prompts = sum(p.chosen.labels.count(IGNORE) for p in pairs)  # answers are all labelled
    assert computed == sum(len(ex.input_ids) for ex in rows) - prompts
    with float64():
        got = sequence_logps(labelled, model, batch)
        assert got.shape == (2 * len(pairs),)
        got.sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)

        expected = torch.stack([_plain_logps(model, ex) for ex in rows])
        assert_close64(got, expected)
        expected.sum().backward()
        assert grads.keys() == {n for n, _ in model.named_parameters()}
        for name, p in model.named_parameters():
            assert_close64(grads[name], p.grad, msg=name)

        # and what they score as plain padded rows
        chosen = sequence_logps(labelled, model, collate([p.chosen for p in pairs], 0))
        rejected = sequence_logps(labelled, model, collate([p.rejected for p in pairs], 0))
        assert_close64(got.detach(), torch.cat([chosen, rejected]).detach())


def test_the_loss_is_the_papers() -> None:
    policy = torch.tensor([-3.0, -5.0, -4.0, -2.0], requires_grad=True)  # chosen, chosen, ...
    reference = torch.tensor([-4.0, -5.0, -3.0, -2.5])
    beta = 0.5
    loss, chosen, rejected = dpo_loss(policy, reference, beta)
    margins = [beta * ((-3 + 4) - (-4 + 3)), beta * ((-5 + 5) - (-2 + 2.5))]
    expected = sum(-math.log(1 / (1 + math.exp(-m))) for m in margins) / 2
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-6)
    assert chosen.tolist() == pytest.approx([0.5, 0.0])
    assert rejected.tolist() == pytest.approx([-0.5, 0.25])
    # at the reference, every pair's loss is log 2
    start, *_ = dpo_loss(reference.clone(), reference, beta)
    assert float(start) == pytest.approx(math.log(2))
    loss.backward()  # the gradient raises the chosen and lowers the rejected answer
    assert policy.grad is not None
    assert (policy.grad[:2] <= 0).all() and (policy.grad[2:] >= 0).all()


@pytest.mark.parametrize("method", ["lora", "ia3"])
def test_the_reference_with_the_adapter_off_is_the_base(tiny: Path, method: str) -> None:
    from transformers import AutoModelForCausalLM

    built = _built(tiny, method)
    with torch.no_grad():  # move the adapter away from its identity start
        for p in built.model.parameters():
            if p.requires_grad:
                p.add_(0.3 * torch.randn_like(p))
    labelled = LabelledLogits(built.model.get_output_embeddings())
    reference = Reference("adapter_disabled", peft_model=built.model, labelled=labelled)
    batch, _ = collate_pairs(_pairs(), 0)
    base = double(AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval())
    rows = [p.chosen for p in _pairs()] + [p.rejected for p in _pairs()]
    with float64():
        got = reference.logps(batch, "train", [0, 1, 2])
        assert not got.requires_grad
        policy = sequence_logps(labelled, built.model, batch).detach()
        with torch.no_grad():
            expected = torch.stack([_plain_logps(base, ex) for ex in rows])
    assert_close64(got, expected)
    # the adapter is on again: far outside that bound
    assert (policy - got).abs().max() > 1e3 * bound64(float(expected.abs().max()))


def test_precomputed_scores_are_looked_up_by_pair_and_survive_a_checkpoint(tiny: Path) -> None:
    model = _built(tiny, "full").model.eval()
    labelled = LabelledLogits(model.get_output_embeddings())
    reference = Reference("precomputed", labelled=labelled)
    pairs = _pairs()

    def score(picked: list[PreferencePair]) -> torch.Tensor:
        return sequence_logps(labelled, model, collate_pairs(picked, 0)[0])

    picked = [2, 0]
    with float64():  # micro-batches of 2 pairs and 1, against all 3 at once
        reference.precompute("train", pairs, score, micro=2, rank=0, world=1,
                             device=torch.device("cpu"))  # fmt: skip
        with torch.no_grad():
            whole = score(pairs)
        expected = torch.cat([whole[picked], whole[[3 + i for i in picked]]])
        looked_up = reference.logps({}, "train", picked)
    assert_close64(looked_up, expected)
    again = Reference("precomputed", labelled=labelled)
    again.restore(json.loads(json.dumps(reference.saved())))
    assert torch.equal(again.logps({}, "train", picked), reference.logps({}, "train", picked))


PREFERENCE = {
    "input": {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "what color is an apple"},
            {"role": "assistant", "content": "which apple"},
            {"role": "user", "content": "a red one"},
        ]
    },
    "preferred_output": [{"role": "assistant", "content": "red"}],
    "non_preferred_output": [{"role": "assistant", "content": "it is green and blue"}],
}


def test_a_preference_line_is_two_sequences_labelled_on_their_answers(
    tmp_path: Path, tokenizer: Any
) -> None:
    pair = tokenize_example(tokenizer, PREFERENCE)
    assert isinstance(pair, PreferencePair)
    prompt = tokenizer.apply_chat_template(
        PREFERENCE["input"]["messages"], tokenize=False, add_generation_prompt=True
    )
    n = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    for ex, answer in [(pair.chosen, "red"), (pair.rejected, "it is green and blue")]:
        assert ex.input_ids[:n] == pair.chosen.input_ids[:n]  # the same prompt
        assert all(label == IGNORE for label in ex.labels[:n])  # its assistant turn too
        trained = tokenizer.decode([t for t in ex.labels if t != IGNORE])
        assert trained == answer + "<|im_end|>\n"

    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(PREFERENCE) + "\n\n" + json.dumps(PREFERENCE) + "\n")
    stats = token_stats(path, tokenizer, max_seq_len=n + 3)
    tokens = len(pair.chosen.input_ids) + len(pair.rejected.input_ids)
    trained = sum(label != IGNORE for ex in pair.sequences for label in ex.labels)
    assert stats == {
        "examples": 2,
        "tokens": 2 * tokens,
        "trained_tokens": 2 * trained,
        "over_max_seq_len": 2,  # the rejected answer is longer than 3 tokens
        "max_seq_len": n + 3,
    }
    # cut to n + 3 tokens, both answers keep labels: the pairs stay, counted as truncated
    data = load_dataset(path, tokenizer, n + 3)
    assert data.preference and len(data.examples) == 2 and data.truncated == 2
    assert all(len(ex.input_ids) <= n + 3 for p in data.examples for ex in p.sequences)
    # cut inside the prompt, an answer has nothing left to learn: the pair is dropped
    assert load_dataset(path, tokenizer, n - 2).examples == []


def test_the_loss_gradient_through_one_forward_equals_two(tiny: Path) -> None:
    """The DPO loss from one forward pass of both sequences has the gradients of the loss
    from a forward pass of each."""
    built = _built(tiny, "lora")
    model = built.model
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn_like(p))
    labelled = LabelledLogits(model.get_output_embeddings())
    pairs = _pairs()
    reference = torch.randn(2 * len(pairs), dtype=torch.float64) - 20
    with float64():
        policy = sequence_logps(labelled, model, collate_pairs(pairs, 0)[0])
        loss, *_ = dpo_loss(policy, reference, 0.1)
        loss.backward()
        one = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        chosen = sequence_logps(labelled, model, collate([p.chosen for p in pairs], 0))
        rejected = sequence_logps(labelled, model, collate([p.rejected for p in pairs], 0))
        margin = 0.1 * ((chosen - reference[:3]) - (rejected - reference[3:]))
        (-F.logsigmoid(margin).mean()).backward()
    two = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert one.keys() == two.keys() and one  # the adapter's parameters, nothing else
    for name, grad in two.items():
        assert_close64(one[name], grad, msg=name)
