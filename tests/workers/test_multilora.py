"""Batched multi-LoRA decoding on a tiny random Llama: each request of a heterogeneous
batch (different adapters, ranks, targets, prompt lengths, the bare base) gets the tokens
that adapter gives alone, through peft and merged; the adapter cache evicts LRU, keeps
pinned adapters and ones in flight, and refuses adapters it cannot apply exactly."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tinyllm import save_random_lora
from tunefleet.workers.serve.engine import BatchEngine, generate_all
from tunefleet.workers.serve.generate import Sampling, eos_ids
from tunefleet.workers.serve.multilora import (
    AdapterCache,
    AdapterError,
    CacheFullError,
    MultiLoraModel,
)

TINY = "tiny-llama"
GREEDY = Sampling(max_tokens=10, temperature=0)
ADAPTERS = {  # id -> shape: ranks, targets and scaling differ
    "a1": {"r": 4, "targets": ("q_proj", "v_proj")},
    "a2": {"r": 8, "targets": ("q_proj", "k_proj", "v_proj", "o_proj")},
    "a3": {"r": 2, "targets": ("gate_proj", "up_proj", "down_proj"), "use_rslora": True},
    "a4": {"r": 16, "targets": ("v_proj", "down_proj")},
}


@pytest.fixture(scope="module")
def setup(tiny_registry: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_registry / TINY
    folder = tmp_path_factory.mktemp("adapters")
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for seed, (name, shape) in enumerate(ADAPTERS.items()):
        save_random_lora(base, folder / name, seed=seed, **shape)
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [
        tok(text)["input_ids"]
        for text in ("what color is the sky", "one two", "name a fruit please now", "hi")
    ]
    return {"path": path, "folder": folder, "tok": tok, "prompts": prompts}


def _server(setup: dict[str, Any], max_adapters: int = 8) -> tuple[BatchEngine, AdapterCache]:
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(setup["path"], dtype=torch.float32).eval()
    lora = MultiLoraModel(base, max_adapters=max_adapters)
    cache = AdapterCache(lora, locate=lambda a: setup["folder"] / a)
    engine = BatchEngine(lora, eos_ids(base, setup["tok"]), max_batch_size=16)
    return engine, cache


def _peft_reference(setup: dict[str, Any], adapter: str | None, prompt: list[int]) -> list[int]:
    """peft alone (one adapter, ``generate``), cut at the end of text as the server does."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(setup["path"], dtype=torch.float32).eval()
    model: Any = (
        base if adapter is None else PeftModel.from_pretrained(base, setup["folder"] / adapter)
    )
    with torch.inference_mode():
        out = model.generate(
            input_ids=torch.tensor([prompt]), max_new_tokens=GREEDY.max_tokens, do_sample=False
        )
    ids = [int(t) for t in out[0, len(prompt) :]]
    eos = eos_ids(base, setup["tok"])
    return next((ids[:i] for i, t in enumerate(ids) if t in eos), ids)


def _merged_reference(setup: dict[str, Any], adapter: str, prompt: list[int]) -> list[int]:
    """The adapter merged into a copy of the base (``merge_and_unload``), decoded alone by
    the same engine with no adapters."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(setup["path"], dtype=torch.float32).eval()
    merged = PeftModel.from_pretrained(base, setup["folder"] / adapter).merge_and_unload()
    engine = BatchEngine(MultiLoraModel(merged, max_adapters=1), eos_ids(merged, setup["tok"]))
    return generate_all(engine, setup["tok"], [(prompt, GREEDY, 0)])[0].token_ids


def test_heterogeneous_batch_matches_each_adapter_alone_and_merged(setup: dict[str, Any]) -> None:
    engine, cache = _server(setup)
    names = [None, *ADAPTERS]
    # every (adapter, prompt) pair, so rows of one batch differ in adapter and length
    items = [(p, GREEDY, cache.acquire(a) if a else 0) for a in names for p in setup["prompts"]]
    batched = generate_all(engine, setup["tok"], items)
    k = 0
    outputs: dict[str | None, list[list[int]]] = {}
    for a in names:
        for p in setup["prompts"]:
            got = batched[k].token_ids
            assert got == _peft_reference(setup, a, p), (a, p)
            alone = generate_all(engine, setup["tok"], [(p, GREEDY, items[k][2])])[0]
            assert got == alone.token_ids, (a, p)
            if a is not None:
                assert got == _merged_reference(setup, a, p), (a, p)
            outputs.setdefault(a, []).append(got)
            k += 1
    # the adapters really change the answers
    assert len({json.dumps(v) for v in outputs.values()}) == len(names)


def test_rows_join_and_leave_a_running_batch(setup: dict[str, Any]) -> None:
    """A request that arrives while others decode joins at the next step; its tokens are
    what it gets alone, and so are those of the rows already running."""
    engine, cache = _server(setup)
    long_p, short_p = setup["prompts"][2], setup["prompts"][3]
    first = [(long_p, GREEDY, cache.acquire("a1")), (short_p, Sampling(3, 0), cache.acquire("a2"))]
    late = (short_p, GREEDY, cache.acquire("a4"))
    expected = [generate_all(engine, setup["tok"], [it])[0].token_ids for it in [*first, late]]

    got: dict[int, list[int]] = {0: [], 1: [], 2: []}

    def sink(i: int) -> Any:
        return lambda token, finish: token is not None and got[i].append(token)

    for i, (p, s, slot) in enumerate(first):
        engine.submit(p, s, slot, sink(i))
    for _ in range(4):  # prefill + 3 decode steps; row 1 (3 tokens) has left the batch
        engine.step()
    assert len(engine.active) == 1
    engine.submit(late[0], late[1], late[2], sink(2))
    engine.run_until_idle()
    assert [got[0], got[1], got[2]] == expected


def test_cache_evicts_lru_keeps_pinned_and_in_flight(setup: dict[str, Any]) -> None:
    loaded: list[str] = []
    evicted: list[str] = []
    _, cache = _server(setup, max_adapters=2)
    cache.on_load, cache.on_evict = loaded.append, evicted.append
    cache.acquire("a1", pin=True, hold=False)
    s2 = cache.acquire("a2", hold=False)
    s3 = cache.acquire("a3")  # full: a2 is the LRU unpinned one
    assert evicted == ["a2"] and s3 == s2
    with pytest.raises(CacheFullError, match="pinned adapters or adapters with requests"):
        cache.acquire("a4")  # a1 pinned, a3 in flight
    cache.release("a3")
    cache.acquire("a4", hold=False)
    assert evicted == ["a2", "a3"]
    assert {e["id"] for e in cache.loaded()} == {"a1", "a4"}
    assert loaded == ["a1", "a2", "a3", "a4"]
    cache.acquire("a1", pin=False, hold=False)
    assert cache.unload("a1") and not cache.unload("a1")
    assert all(e["load_ms"] < 1000 for e in cache.loaded())


def test_unusable_adapters_are_refused_by_name(
    setup: dict[str, Any], tmp_path: Path, tiny_registry: Path
) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    _, cache = _server(setup)
    cache.locate = lambda a: tmp_path / a
    with pytest.raises(AdapterError, match="not a peft adapter folder"):
        cache.acquire("missing")
    base = AutoModelForCausalLM.from_pretrained(tiny_registry / TINY)
    dora = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"], use_dora=True))
    dora.save_pretrained(tmp_path / "dora")
    with pytest.raises(AdapterError, match="DoRA"):
        cache.acquire("dora")

    def llama(hidden: int, layers: int) -> Any:
        return LlamaForCausalLM(
            LlamaConfig(
                vocab_size=64,
                hidden_size=hidden,
                intermediate_size=2 * hidden,
                num_hidden_layers=layers,
                num_attention_heads=4,
                num_key_value_heads=2,
            )
        )

    other = llama(hidden=32, layers=1)
    save_random_lora(other, tmp_path / "other")
    with pytest.raises(AdapterError, match="trained for another base model"):
        cache.acquire("other")
    deeper = llama(hidden=64, layers=4)
    save_random_lora(deeper, tmp_path / "deeper")  # targets layers 2 and 3 the base lacks
    with pytest.raises(AdapterError, match="not a linear layer of this base model"):
        cache.acquire("deeper")
    assert cache.loaded() == []  # nothing half-loaded


def test_copy_of_base_is_untouched(setup: dict[str, Any]) -> None:
    """Wrapping replaces modules of the model it is given, nothing else."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(setup["path"], dtype=torch.float32)
    keep = copy.deepcopy(base)
    lora = MultiLoraModel(base, max_adapters=2)
    AdapterCache(lora, locate=lambda a: setup["folder"] / a).acquire("a2", hold=False)
    assert type(keep.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    assert type(base.model.layers[0].self_attn.q_proj).__name__ == "BatchedLoraLinear"


def test_qlora_adapter_on_a_4bit_base_and_merged_into_its_dequantized_copy(
    setup: dict[str, Any],
) -> None:
    """An adapter served on an NF4 base gives peft's tokens on that base; merged into the
    de-quantized base (what merged mode does with a 4-bit base) it gives the same."""
    from peft import PeftModel

    from tunefleet.workers.serve.multilora import load_base

    base = load_base(setup["path"], "nf4")
    assert getattr(base, "is_loaded_in_4bit", False)
    lora = MultiLoraModel(base, max_adapters=2)
    slot = AdapterCache(lora, locate=lambda a: setup["folder"] / a).acquire("a2", hold=False)
    engine = BatchEngine(lora, eos_ids(base, setup["tok"]))
    prompts = setup["prompts"][:2]
    got = generate_all(engine, setup["tok"], [(p, GREEDY, slot) for p in prompts])

    peft = PeftModel.from_pretrained(load_base(setup["path"], "nf4"), setup["folder"] / "a2")
    for p, g in zip(prompts, got, strict=True):
        with torch.inference_mode():
            out = peft.generate(input_ids=torch.tensor([p]), max_new_tokens=10, do_sample=False)
        ref = [int(t) for t in out[0, len(p) :]]
        eos = eos_ids(base, setup["tok"])
        ref = next((ref[:i] for i, t in enumerate(ref) if t in eos), ref)
        assert g.token_ids == ref

    merged_base = lora.base_copy().dequantize()
    merged = PeftModel.from_pretrained(merged_base, setup["folder"] / "a2").merge_and_unload()
    alone = BatchEngine(MultiLoraModel(merged, max_adapters=1), eos_ids(merged, setup["tok"]))
    again = generate_all(alone, setup["tok"], [(p, GREEDY, 0) for p in prompts])
    assert [a.token_ids for a in again] == [g.token_ids for g in got]


def test_a_failed_step_fails_its_rows_and_the_engine_goes_on(
    setup: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, _ = _server(setup)
    forward = engine._forward
    calls = {"n": 0}

    def flaky(*args: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:  # the first decode step
            raise RuntimeError("boom")
        return forward(*args)

    monkeypatch.setattr(engine, "_forward", flaky)
    got: list[Any] = []
    for p in setup["prompts"][:2]:
        engine.submit(p, GREEDY, 0, lambda token, finish: finish is not None and got.append(finish))
    engine.run_until_idle()
    assert len(got) == 2 and all(isinstance(f, RuntimeError) for f in got)
    assert engine.active == [] and engine.cache is None
    done = generate_all(engine, setup["tok"], [(setup["prompts"][0], GREEDY, 0)])
    assert done[0].completion_tokens > 0
