"""The serving app's decoder on a tiny random Llama with a LoRA adapter: greedy decoding
matches transformers' ``generate`` for the base and the adapter, streamed deltas add up to
the whole text, stop strings cut it, seeded sampling repeats."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tunefleet.workers.serve.generate import Finished, Sampling, complete, decode

TINY = "tiny-llama"


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_registry: Path) -> tuple[Any, Any]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    path = tiny_registry / TINY
    tokenizer = AutoTokenizer.from_pretrained(path)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]), "ad1")
    with torch.no_grad():  # a LoRA that changes the outputs (B starts at zero)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    model.eval()
    return model, tokenizer


def _reference(model: Any, prompt: list[int], n: int, adapter: str | None) -> list[int]:
    with torch.inference_mode():
        if adapter is None:
            with model.disable_adapter():
                out = model.generate(
                    input_ids=torch.tensor([prompt]), max_new_tokens=n, do_sample=False
                )
        else:
            model.set_adapter(adapter)
            out = model.generate(
                input_ids=torch.tensor([prompt]), max_new_tokens=n, do_sample=False
            )
    return [int(t) for t in out[0, len(prompt) :]]


def test_greedy_matches_generate_for_base_and_adapter(model_and_tokenizer: Any) -> None:
    model, tok = model_and_tokenizer
    prompt = tok("what color is the sky")["input_ids"]
    greedy = Sampling(max_tokens=12, temperature=0)
    base = complete(model, tok, prompt, greedy)
    tuned = complete(model, tok, prompt, greedy, adapter_id="ad1")
    eos = model.generation_config.eos_token_id
    for got, ref in (
        (base, _reference(model, prompt, 12, None)),
        (tuned, _reference(model, prompt, 12, "ad1")),
    ):
        ref = ref[: ref.index(eos)] if eos in ref else ref
        assert got.token_ids == ref
    assert base.token_ids != tuned.token_ids  # the adapter is applied per request


def test_stream_deltas_add_up_and_stop_strings_cut(model_and_tokenizer: Any) -> None:
    model, tok = model_and_tokenizer
    prompt = tok("name a fruit")["input_ids"]
    items = list(decode(model, tok, prompt, Sampling(max_tokens=20, temperature=0)))
    *deltas, end = items
    assert isinstance(end, Finished) and all(isinstance(d, str) for d in deltas)
    assert "".join(deltas) == end.text  # type: ignore[arg-type]
    assert end.completion_tokens == len(end.token_ids) <= 20
    assert end.finish_reason in ("length", "stop")
    assert len(end.text) > 4
    stop = end.text[2:4]
    cut = complete(model, tok, prompt, Sampling(max_tokens=20, temperature=0, stop=(stop,)))
    assert cut.text == end.text[: end.text.index(stop)] and cut.finish_reason == "stop"
    streamed = list(
        decode(model, tok, prompt, Sampling(max_tokens=20, temperature=0, stop=(stop,)))
    )
    assert "".join(x for x in streamed if isinstance(x, str)) == cut.text


def test_seeded_sampling_repeats_and_top_p_narrows(model_and_tokenizer: Any) -> None:
    model, tok = model_and_tokenizer
    prompt = tok("hello")["input_ids"]
    hot = Sampling(max_tokens=10, temperature=1.5, seed=7)
    assert (
        complete(model, tok, prompt, hot).token_ids == complete(model, tok, prompt, hot).token_ids
    )
    other = Sampling(max_tokens=10, temperature=1.5, seed=8)
    assert (
        complete(model, tok, prompt, hot).token_ids != complete(model, tok, prompt, other).token_ids
    )
    # top_p so small that only the most likely token is left: greedy
    narrow = Sampling(max_tokens=10, temperature=1.0, top_p=1e-6, seed=3)
    greedy = Sampling(max_tokens=10, temperature=0)
    assert (
        complete(model, tok, prompt, narrow).token_ids
        == complete(model, tok, prompt, greedy).token_ids
    )
