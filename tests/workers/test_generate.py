"""Decoding through the serving engine on a tiny random Llama with a LoRA adapter: greedy
decoding matches transformers' ``generate`` for the base and the adapter, streamed deltas
add up to the whole text, stop strings cut it, seeded sampling repeats."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tinyllm import save_random_lora
from tunefleet.workers.serve.adapter_cache import AdapterCache
from tunefleet.workers.serve.engine import BatchEngine, generate_all
from tunefleet.workers.serve.generate import Finished, Sampling, TextStream, eos_ids
from tunefleet.workers.serve.multilora import MultiLoraModel

TINY = "tiny-llama"


@pytest.fixture(scope="module")
def server(tiny_registry: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_registry / TINY
    folder = tmp_path_factory.mktemp("adapter") / "ad1"
    save_random_lora(AutoModelForCausalLM.from_pretrained(path), folder)
    tok = AutoTokenizer.from_pretrained(path)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    lora = MultiLoraModel(base, max_adapters=2)
    slot = AdapterCache(lora, locate=lambda _: folder).acquire("ad1", hold=False)
    engine = BatchEngine(lora, eos_ids(base, tok))
    return {"path": path, "folder": folder, "tok": tok, "engine": engine, "slot": slot}


def complete(server: dict[str, Any], prompt: list[int], sampling: Sampling, slot: int = 0) -> Any:
    return generate_all(server["engine"], server["tok"], [(prompt, sampling, slot)])[0]


def _reference(server: dict[str, Any], prompt: list[int], n: int, adapter: bool) -> list[int]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(server["path"], dtype=torch.float32)
    if adapter:
        model = PeftModel.from_pretrained(model, server["folder"])
    with torch.inference_mode():
        out = model.eval().generate(
            input_ids=torch.tensor([prompt]), max_new_tokens=n, do_sample=False
        )
    return [int(t) for t in out[0, len(prompt) :]]


def test_greedy_matches_generate_for_base_and_adapter(server: dict[str, Any]) -> None:
    prompt = server["tok"]("what color is the sky")["input_ids"]
    greedy = Sampling(max_tokens=12, temperature=0)
    base = complete(server, prompt, greedy)
    tuned = complete(server, prompt, greedy, server["slot"])
    eos = server["tok"].eos_token_id
    for got, ref in (
        (base, _reference(server, prompt, 12, False)),
        (tuned, _reference(server, prompt, 12, True)),
    ):
        ref = ref[: ref.index(eos)] if eos in ref else ref
        assert got.token_ids == ref
    assert base.token_ids != tuned.token_ids  # the adapter is applied per request


def _stream(server: dict[str, Any], prompt: list[int], sampling: Sampling) -> list[Any]:
    """What a streaming client gets: text deltas, then Finished."""
    done = complete(server, prompt, Sampling(sampling.max_tokens, 0))  # the token ids
    text = TextStream(server["tok"], sampling, len(prompt))
    items: list[Any] = []
    for token in done.token_ids:
        delta, finished = text.push(token)
        items += [delta] if delta else []
        if finished is not None:
            return [*items, finished]
    delta, finished = text.finish(done.finish_reason)
    return [*items, *([delta] if delta else []), finished]


def test_stream_deltas_add_up_and_stop_strings_cut(server: dict[str, Any]) -> None:
    prompt = server["tok"]("name a fruit")["input_ids"]
    *deltas, end = _stream(server, prompt, Sampling(max_tokens=20, temperature=0))
    assert isinstance(end, Finished) and all(isinstance(d, str) for d in deltas)
    assert "".join(deltas) == end.text
    assert end.completion_tokens == len(end.token_ids) <= 20
    assert end.finish_reason in ("length", "stop")
    assert len(end.text) > 4
    stop = end.text[2:4]
    cut = complete(server, prompt, Sampling(max_tokens=20, temperature=0, stop=(stop,)))
    assert cut.text == end.text[: end.text.index(stop)] and cut.finish_reason == "stop"
    *streamed, last = _stream(server, prompt, Sampling(20, 0, stop=(stop,)))
    assert "".join(streamed) == cut.text == last.text


def test_seeded_sampling_repeats_and_top_p_narrows(server: dict[str, Any]) -> None:
    prompt = server["tok"]("hello")["input_ids"]
    hot = Sampling(max_tokens=10, temperature=1.5, seed=7)
    assert complete(server, prompt, hot).token_ids == complete(server, prompt, hot).token_ids
    other = Sampling(max_tokens=10, temperature=1.5, seed=8)
    assert complete(server, prompt, hot).token_ids != complete(server, prompt, other).token_ids
    # seeded rows keep their own draws when batched with others
    alone = complete(server, prompt, hot).token_ids
    together = generate_all(
        server["engine"], server["tok"], [(prompt, hot, 0), (prompt, other, server["slot"])]
    )
    assert together[0].token_ids == alone
    # top_p so small that only the most likely token is left: greedy
    narrow = Sampling(max_tokens=10, temperature=1.0, top_p=1e-6, seed=3)
    greedy = Sampling(max_tokens=10, temperature=0)
    assert complete(server, prompt, narrow).token_ids == complete(server, prompt, greedy).token_ids
