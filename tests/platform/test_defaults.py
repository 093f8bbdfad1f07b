"""What "auto" hyperparameters settle on (``defaults``): epochs by the training file's
size (OpenAI's rule), batch size by the file and the workers, the learning rate by the
method and the model's width; every result a valid spec's."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tunefleet.platform import _defaults as defaults
from tunefleet.platform.spec import BASE_LEARNING_RATE

AUTO = {"n_epochs": "auto", "batch_size": "auto", "learning_rate_multiplier": "auto"}
SMOLLM = {"hidden_size": 576}


@pytest.mark.parametrize(
    ("examples", "epochs"),
    [(None, 3), (1, 25), (10, 10), (30, 4), (34, 3), (120, 3), (8333, 3), (8334, 2),
     (20_000, 1), (10**7, 1)],
)  # fmt: skip
def test_epochs_follow_the_file_size_as_openai_does(examples: int | None, epochs: int) -> None:
    assert defaults.n_epochs(examples)[0] == epochs


@pytest.mark.parametrize(
    ("examples", "workers", "batch"),
    [(None, 1, 4), (10, 1, 4), (120, 1, 4), (300, 1, 8), (500, 1, 16), (10**6, 1, 32),
     (120, 8, 8), (120, 64, 64)],
)  # fmt: skip
def test_batch_size_follows_the_file_and_the_workers(
    examples: int | None, workers: int, batch: int
) -> None:
    assert defaults.batch_size(examples, workers)[0] == batch


def test_the_learning_rate_falls_as_models_widen() -> None:
    rates = [defaults.base_learning_rate("lora", {"hidden_size": h})[0]
             for h in (576, 2048, 4096, 8192)]  # fmt: skip
    assert rates == sorted(rates, reverse=True)
    assert rates[0] == pytest.approx(1.32e-3, rel=0.01)  # SmolLM2-135M
    assert rates[2] == pytest.approx(2.86e-4, rel=0.01)  # an 8B
    full = defaults.base_learning_rate("full", {"hidden_size": 4096})[0]
    assert full == pytest.approx(rates[2] / 10, rel=0.01)
    # narrower than the fit's reach: the rate at MIN_WIDTH
    assert (
        defaults.base_learning_rate("lora", {"hidden_size": 64})[0]
        == (defaults.base_learning_rate("lora", {"hidden_size": defaults.MIN_WIDTH})[0])
    )
    # other methods keep their own base rate
    assert defaults.base_learning_rate("ia3", SMOLLM)[0] == BASE_LEARNING_RATE["ia3"]


def test_settle_says_what_each_auto_became_and_keeps_what_was_set() -> None:
    settled = defaults.settle(AUTO, method="lora", config=SMOLLM, examples=300, workers=1)
    assert settled.hyperparameters.model_dump() == {
        "n_epochs": 3, "batch_size": 8, "learning_rate_multiplier": 1.0
    }  # fmt: skip
    assert settled.reasons.keys() == AUTO.keys()
    assert settled.describe() == (
        "auto settled n_epochs 3 (300 examples); batch_size 8 (300 examples: about 38 steps "
        "an epoch); learning rate 0.00132 (lora on a model 576 wide)"
    )
    asked = {"n_epochs": 2, "batch_size": 16, "learning_rate_multiplier": 0.5}
    kept = defaults.settle(asked, method="lora", config=SMOLLM, examples=300, workers=1)
    assert kept.hyperparameters.model_dump() == asked
    assert kept.reasons == {} and kept.describe() == ""
    assert kept.base_learning_rate == settled.base_learning_rate  # the multiplier scales it


@given(st.one_of(st.none(), st.integers(1, 10**9)), st.integers(1, 4096))
def test_every_settled_value_is_a_valid_specs(examples: int | None, workers: int) -> None:
    settled = defaults.settle(AUTO, method="lora", config=SMOLLM, examples=examples,
                              workers=workers)  # fmt: skip
    hp = settled.hyperparameters
    assert 1 <= hp.n_epochs <= defaults.MAX_EPOCHS and hp.batch_size >= min(workers, 4096)
