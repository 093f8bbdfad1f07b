"""RoPE scaling from the job spec reaches the model the training loop builds: the
rotary embedding of a tiny Llama (context 512) runs the requested scaling, and a sequence
past the base's context runs through it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tunefleet.platform.spec import JobSpec
from tunefleet.workers.train._methods import build_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tinyllm import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("rope") / "tiny")


def _built(path: Path, scaling: dict[str, Any] | None) -> Any:
    spec = JobSpec.model_validate(
        {
            "job_id": "ftjob-rope",
            "tenant_id": "t",
            "model": "tiny",
            "training_file": "file-1",
            "hyperparameters": {"n_epochs": 1, "batch_size": 1, "learning_rate_multiplier": 1},
            "seed": 0,
            "tunefleet": {"rope_scaling": scaling, "lora": {"dropout": 0.0}},
        }
    )
    return build_model(spec, str(path)).model.get_base_model()


@pytest.mark.parametrize("kind", ["linear", "dynamic", "yarn"])
def test_rope_scaling_is_set_on_the_model(tiny: Path, kind: str) -> None:
    plain = _built(tiny, None)
    scaled = _built(tiny, {"type": kind, "factor": 4.0})
    assert scaled.config.rope_parameters["rope_type"] == kind
    # dynamic NTK rescales past max_position_embeddings: it stays the base's
    assert scaled.config.max_position_embeddings == (512 if kind == "dynamic" else 4 * 512)
    assert scaled.config._attn_implementation == "sdpa"
    base_freq, rotary = plain.model.rotary_emb.inv_freq, scaled.model.rotary_emb
    if kind == "linear":  # position interpolation: every frequency divided by the factor
        assert torch.allclose(rotary.inv_freq, base_freq / 4)
    elif kind == "yarn":  # high frequencies kept, low ones interpolated, a temperature
        assert torch.allclose(rotary.inv_freq[0], base_freq[0])
        assert torch.allclose(rotary.inv_freq[-1], base_freq[-1] / 4, rtol=1e-3)
        assert rotary.attention_scaling > 1
    else:  # dynamic NTK: unchanged within the original context, rescaled beyond it
        assert rotary.rope_type == "dynamic"
    ids = torch.randint(0, plain.config.vocab_size, (1, 1024))  # twice the base's context
    with torch.no_grad():
        logits = scaled(input_ids=ids).logits
        unscaled = plain(input_ids=ids).logits
    assert torch.isfinite(logits).all()
    assert not torch.allclose(logits[0, -1], unscaled[0, -1])
