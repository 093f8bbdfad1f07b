"""Decoding through the serving engine on a tiny random Llama with a LoRA adapter: greedy
decoding matches transformers' ``generate`` for the base and the adapter, streamed deltas
add up to the whole text, stop strings cut it, seeded sampling repeats.

Greedy tokens and log-probabilities are held to the float64 model (``float64.py``):
each token its argmax or within float32 rounding of its top score at a near tie
(``assert_greedy``), each log-probability within two float32 logit errors
(``logit_error``). Two float32 computations (the engine's, transformers') may part at a
near tie, and where depends on the CPU's kernels."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import torch

from float64 import assert_greedy, double, float64, logit_error
from tinyllm import save_random_lora
from tunefleet.workers.serve._adapter_cache import AdapterCache
from tunefleet.workers.serve._engine import BatchEngine, generate_all
from tunefleet.workers.serve._generate import Finished, Sampling, TextStream, eos_ids
from tunefleet.workers.serve._multilora import MultiLoraModel
from tunefleet.workers.serve._structured import Grammars

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
    eos = eos_ids(base, tok)
    engine = BatchEngine(lora, eos, grammars=Grammars(tok, eos))
    return {
        "path": path, "folder": folder, "tok": tok, "engine": engine, "slot": slot, "eos": eos,
        # the models every answer is held to, in float64: the base, and peft's with ad1
        "base64": double(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()),
        "tuned64": double(_tuned_model({"path": path, "folder": folder})),
    }  # fmt: skip


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
    for got, ref, model in (
        (base, _reference(server, prompt, 12, False), server["base64"]),
        (tuned, _reference(server, prompt, 12, True), server["tuned64"]),
    ):
        ref = ref[: ref.index(eos)] if eos in ref else ref
        assert_greedy(model, prompt, got.token_ids, 12, server["eos"], msg="engine")
        assert_greedy(model, prompt, ref, 12, server["eos"], msg="generate")
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
    # logprobs cover the tokens of the text kept, not those of the stop string after it
    asked = complete(server, prompt, Sampling(20, 0, stop=(stop,), logprobs=0))
    assert asked.logprobs is not None and asked.text == cut.text
    tokens = [e.token for e in asked.logprobs]
    decode = server["tok"].decode
    assert len(decode(tokens[:-1])) < len(cut.text) <= len(decode(tokens))


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
    zero = Sampling(max_tokens=10, temperature=1.0, top_p=0, seed=3)  # OpenAI allows 0
    assert complete(server, prompt, zero).token_ids == complete(server, prompt, greedy).token_ids


def _tuned_model(server: dict[str, Any]) -> Any:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(server["path"], dtype=torch.float32)
    return PeftModel.from_pretrained(base, server["folder"]).eval()


def test_logprobs_are_the_models_own_log_softmax(server: dict[str, Any]) -> None:
    """Each sampled token's logprob and the top 5 are log_softmax of the adapter model's
    logits (peft, one sequence at a time, float64), batched beside other rows: within two
    float32 logit errors (a log-probability is a logit less a log-sum-exp of logits, each
    off by at most one), 3.6e-3 to 4.6e-3 here, where a temperature left in (0.8) or a
    position off by one moves them by 0.1 or more."""
    prompts = [server["tok"](q)["input_ids"] for q in ("name a fruit", "what is the sky")]
    asked = Sampling(max_tokens=8, temperature=0.8, seed=5, logprobs=5)
    plain = Sampling(max_tokens=8, temperature=0)
    items = [(prompts[0], asked, server["slot"]), (prompts[1], plain, 0)]
    got, other = generate_all(server["engine"], server["tok"], items)
    assert other.logprobs is None and got.logprobs is not None
    assert len(got.logprobs) == got.completion_tokens > 0
    model = server["tuned64"]
    with torch.inference_mode(), float64():
        out = model(input_ids=torch.tensor([prompts[0] + got.token_ids]), output_hidden_states=True)
        at = slice(len(prompts[0]) - 1, None)
        reference = torch.log_softmax(out.logits[0, at], -1)
        allowed = 2 * logit_error(model, out.hidden_states[-1][0, at])
    for k, entry in enumerate(got.logprobs):
        assert entry.token == got.token_ids[k]
        assert abs(entry.logprob - float(reference[k, entry.token])) <= allowed[k]
        # the top 5 by value, in order: within the bound of the float64 values, and no
        # token left out beats one listed by more than the bound (a near tie may swap)
        tokens = [t for t, _ in entry.top]
        listed = reference[k, tokens]
        assert len(set(tokens)) == 5
        for (_, lp), exact in zip(entry.top, listed.tolist(), strict=True):
            assert abs(lp - exact) <= allowed[k]
        assert all(a >= b - 2 * allowed[k] for a, b in pairwise(listed))
        rest = reference[k].clone()
        rest[tokens] = -torch.inf
        assert float(rest.max()) <= float(listed.min()) + 2 * allowed[k]


def test_penalties_and_logit_bias_follow_openais_formula(server: dict[str, Any]) -> None:
    """Greedy decoding with logit_bias, presence and frequency penalties gives the tokens of
    a plain loop over the adapter model that applies OpenAI's formula: logit + bias -
    count x frequency - (count > 0) x presence."""
    prompt = server["tok"]("name a fruit")["input_ids"]
    plain = complete(server, prompt, Sampling(max_tokens=12, temperature=0), server["slot"])
    banned = plain.token_ids[0]
    s = Sampling(
        max_tokens=12,
        temperature=0,
        presence_penalty=0.7,
        frequency_penalty=1.3,
        logit_bias=((banned, -100.0), (7, 2.5)),
    )
    got = complete(server, prompt, s, server["slot"])

    def openai(scores: torch.Tensor, tokens: list[int]) -> torch.Tensor:
        scores = scores.clone()
        scores[banned] -= 100
        scores[7] += 2.5
        for t in set(tokens):
            scores[t] -= tokens.count(t) * 1.3 + 0.7
        return scores

    model = server["tuned64"]
    assert_greedy(model, prompt, got.token_ids, 12, server["eos"], openai)
    assert banned not in got.token_ids and got.token_ids != plain.token_ids


def test_a_grammar_constrains_every_row_of_a_mixed_batch(server: dict[str, Any]) -> None:
    """Rows with a JSON schema (sampled, on the adapter and on the base) and a row without
    share a batch: each constrained answer parses and follows its schema; the free row's
    tokens are those it gets alone."""
    import json

    grammars: Grammars = server["engine"].grammars
    schema = {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "count": {"type": "integer", "minimum": 0, "maximum": 99},
            "ok": {"type": "boolean"},
        },
        "required": ["color", "count", "ok"],
        "additionalProperties": False,
    }
    grammar = grammars.compile({"type": "json_schema", "json_schema": {"schema": schema}})
    any_object = grammars.compile({"type": "json_object"})
    prompt = server["tok"]("give me json")["input_ids"]
    free = Sampling(max_tokens=10, temperature=0)
    items = [
        (prompt, Sampling(max_tokens=60, temperature=1.0, seed=k, grammar=grammar), slot)
        for k, slot in enumerate([0, server["slot"]] * 3)
    ]
    items += [(prompt, Sampling(max_tokens=60, temperature=0, grammar=any_object), 0)]
    items += [(prompt, free, server["slot"])]
    *constrained, unconstrained = generate_all(server["engine"], server["tok"], items)
    for done in constrained[:-1]:
        value = json.loads(done.text)
        assert done.finish_reason == "stop"
        assert set(value) == {"color", "count", "ok"} and value["color"] in ("red", "green", "blue")
        assert 0 <= value["count"] <= 99 and isinstance(value["ok"], bool)
    # json_object: an object (the greedy walk of a random model may run to its length)
    if constrained[-1].finish_reason == "stop":
        assert isinstance(json.loads(constrained[-1].text), dict)
    else:
        assert constrained[-1].text.startswith("{")
    alone = complete(server, prompt, free, server["slot"]).token_ids
    for tokens, how in ((unconstrained.token_ids, "batched"), (alone, "alone")):
        assert_greedy(server["tuned64"], prompt, tokens, 10, server["eos"], msg=how)
