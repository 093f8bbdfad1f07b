"""Batched multi-LoRA decoding on a tiny random Llama: each request of a heterogeneous
batch (different adapters, ranks, targets, prompt lengths, the bare base) gets the tokens
that adapter gives alone, through peft and merged; the adapter cache evicts LRU, keeps
pinned adapters and ones in flight, and refuses adapters it cannot apply exactly.

Every decode (batched, alone, through peft, merged) is held to the same float64 model,
peft's, at every step (``float64.assert_greedy``): each token is its argmax, or within
float32 rounding of its top score at a near tie. Two float32 decodes may part at such a
tie (about 1 choice in 100 here), and where depends on the CPU's kernels, so they are not
compared with each other token for token."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from float64 import FORWARD, assert_greedy, double, gamma, logit_error
from tinyllm import save_random_lora
from tunefleet.workers._precision import cpu_bf16
from tunefleet.workers.serve._adapter_cache import (
    AdapterCache,
    AdapterInUse,
    AdapterTooLarge,
    CacheFullError,
)
from tunefleet.workers.serve._adapters import AdapterError
from tunefleet.workers.serve._engine import BatchEngine, generate_all
from tunefleet.workers.serve._generate import Sampling, eos_ids
from tunefleet.workers.serve._kvcache import GROW, BatchCache
from tunefleet.workers.serve._multilora import MultiLoraModel
from tunefleet.workers.serve._onednn import PackedLinear, pack_linear

TINY = "tiny-llama"
GREEDY = Sampling(max_tokens=10, temperature=0)
ADAPTERS = {  # id -> shape: ranks, targets and scaling differ
    "a1": {"r": 4, "targets": ("q_proj", "v_proj")},
    "a2": {"r": 8, "targets": ("q_proj", "k_proj", "v_proj", "o_proj")},
    "a3": {"r": 2, "targets": ("gate_proj", "up_proj", "down_proj"), "use_rslora": True},
    "a4": {"r": 16, "targets": ("v_proj", "down_proj")},
    "a5": {"r": 12, "targets": ("q_proj", "o_proj", "up_proj")},  # padded into a4's bucket
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
    eos = eos_ids(base, tok)
    return {"path": path, "folder": folder, "tok": tok, "prompts": prompts, "eos": eos}


@pytest.fixture(scope="module")
def references(setup: dict[str, Any]) -> dict[str | None, Any]:
    """Each adapter on the base through peft alone (None: the bare base), in float64: the
    models of the reference decodes."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    models: dict[str | None, Any] = {}
    for adapter in [None, *ADAPTERS]:
        base = AutoModelForCausalLM.from_pretrained(setup["path"], dtype=torch.float32)
        if adapter is not None:
            base = PeftModel.from_pretrained(base, setup["folder"] / adapter)
        models[adapter] = double(base.eval())
    return models


def _server(setup: dict[str, Any], max_adapters: int = 8) -> tuple[BatchEngine, AdapterCache]:
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(setup["path"], dtype=torch.float32).eval()
    lora = MultiLoraModel(base, max_adapters=max_adapters)
    cache = AdapterCache(lora, locate=lambda a: setup["folder"] / a)
    engine = BatchEngine(lora, eos_ids(base, setup["tok"]), max_batch_size=16)
    return engine, cache


def _check(
    setup: dict[str, Any], references: dict[str | None, Any], adapter: str | None,
    prompt: list[int], tokens: list[int], sampling: Sampling = GREEDY, msg: Any = None,
    eos: set[int] | None = None,
) -> int:  # fmt: skip
    """``tokens`` are the greedy decode of ``prompt`` by peft alone with ``adapter`` (cut
    at the end of text as the server does), within float32 rounding; the choices decided."""
    eos = setup["eos"] if eos is None else eos
    return assert_greedy(references[adapter], prompt, tokens, sampling.max_tokens, eos, msg=msg)


def _merged_engine(setup: dict[str, Any], adapter: str) -> BatchEngine:
    """The adapter merged into a copy of the base (``merge_and_unload``), served by an
    engine with no adapters."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(setup["path"], dtype=torch.float32).eval()
    merged = PeftModel.from_pretrained(base, setup["folder"] / adapter).merge_and_unload()
    return BatchEngine(MultiLoraModel(merged, max_adapters=1), eos_ids(merged, setup["tok"]))


def test_heterogeneous_batch_matches_each_adapter_alone_and_merged(
    setup: dict[str, Any], references: dict[str | None, Any]
) -> None:
    engine, cache = _server(setup)
    names = [None, *ADAPTERS]
    # every (adapter, prompt) pair, so rows of one batch differ in adapter and length
    pairs = [(a, p) for a in names for p in setup["prompts"]]
    items = [(p, GREEDY, cache.acquire(a) if a else 0) for a, p in pairs]
    batched = generate_all(engine, setup["tok"], items)
    merged = {a: _merged_engine(setup, a) for a in ADAPTERS}
    outputs: dict[str | None, list[list[int]]] = {}
    for (a, p), item, got in zip(pairs, items, batched, strict=True):
        _check(setup, references, a, p, got.token_ids, msg=(a, p, "batched"))
        alone = generate_all(engine, setup["tok"], [item])[0].token_ids
        _check(setup, references, a, p, alone, msg=(a, p, "alone"))
        if a is not None:
            tokens = generate_all(merged[a], setup["tok"], [(p, GREEDY, 0)])[0].token_ids
            _check(setup, references, a, p, tokens, msg=(a, p, "merged"))
        outputs.setdefault(a, []).append(got.token_ids)
    # the adapters really change the answers
    assert len({json.dumps(v) for v in outputs.values()}) == len(names)


def test_rows_join_and_leave_a_running_batch(
    setup: dict[str, Any], references: dict[str | None, Any]
) -> None:
    """A request that arrives while others decode joins at the next step; its tokens are
    what it gets alone, and so are those of the rows already running."""
    engine, cache = _server(setup)
    long_p, short_p = setup["prompts"][2], setup["prompts"][3]
    first = [("a1", long_p, GREEDY), ("a2", short_p, Sampling(3, 0))]
    late = ("a4", short_p, GREEDY)
    named = [*first, late]
    items = [(p, s, cache.acquire(a)) for a, p, s in named]
    alone = [generate_all(engine, setup["tok"], [it])[0].token_ids for it in items]

    got: dict[int, list[int]] = {0: [], 1: [], 2: []}

    def sink(i: int) -> Any:
        return lambda token, finish: token is not None and got[i].append(token)

    for i, (p, s, slot) in enumerate(items[:2]):
        engine.submit(p, s, slot, sink(i))
    for _ in range(4):  # prefill + 3 decode steps; row 1 (3 tokens) has left the batch
        engine.step()
    assert len(engine.active) == 1
    engine.submit(*items[2], sink(2))
    engine.run_until_idle()
    for i, (a, p, s) in enumerate(named):
        _check(setup, references, a, p, got[i], s, msg=("joined", a))
        _check(setup, references, a, p, alone[i], s, msg=("alone", a))


def test_cache_evicts_lru_keeps_pinned_and_in_flight(setup: dict[str, Any]) -> None:
    loaded: list[str] = []
    evicted: list[str] = []
    unloaded: list[str] = []  # what the replica unpins in the node cache
    _, cache = _server(setup, max_adapters=2)
    cache.on_load, cache.on_evict = loaded.append, evicted.append
    cache.on_unload = unloaded.append
    cache.acquire("a1", pin=True, hold=False)
    s2 = cache.acquire("a2", hold=False)
    s3 = cache.acquire("a3")  # full: a2 is the LRU unpinned one
    assert evicted == ["a2"] and s3 == s2
    with pytest.raises(CacheFullError, match="pinned adapters or adapters with requests"):
        cache.acquire("a4")  # a1 pinned, a3 in flight
    assert unloaded == ["a2", "a4"]  # evicted, and located but never loaded
    cache.release("a3")
    s4 = cache.acquire("a4", hold=False)
    assert evicted == ["a2", "a3"]
    assert {e["id"] for e in cache.loaded()} == {"a1", "a4"}
    assert loaded == ["a1", "a2", "a3", "a4"]
    s1 = cache.acquire("a1", pin=False, hold=False)
    assert cache.unload("a1") and not cache.unload("a1")
    assert unloaded == ["a2", "a4", "a3", "a1"]
    entries = [(e["id"], e["slot"], e["rank"], e["pinned"], e["in_flight"]) for e in cache.loaded()]
    assert entries == [("a4", s4, 16, False, 0)]
    # What a load guarantees: a4's place holds exactly its file's factors (B times
    # alpha / r, zero-padded to its rank bucket's width), zeros in the layers it does not
    # target; a1's place is gone (the bare base, slot 0, has none).
    from safetensors.torch import load_file

    folder = setup["folder"] / "a4"
    config = json.loads((folder / "adapter_config.json").read_text())
    weights = load_file(str(folder / "adapter_model.safetensors"))
    assert not config["use_rslora"]
    scale = config["lora_alpha"] / config["r"]
    prefix, suffix = "base_model.model.", ".lora_A.weight"
    in_file = {k.removeprefix(prefix).removesuffix(suffix) for k in weights if k.endswith(suffix)}
    assert in_file and in_file <= set(cache.lora.layers)
    assert set(cache.lora.where) == {s4} and s1 != s4
    for name in cache.lora.layers:
        got_a, got_b = cache.lora.factors(s4, name)
        if name in in_file:
            a = weights[f"{prefix}{name}.lora_A.weight"].float()
            b = weights[f"{prefix}{name}.lora_B.weight"].float()
            r = a.shape[0]
            assert got_a.shape[1] == got_b.shape[0] == 16  # rank 16: its own bucket
            assert torch.equal(got_a[:, :r], a.T) and not got_a[:, r:].any()
            assert torch.equal(got_b[:r], (b * scale).T) and not got_b[r:].any()
        else:
            assert not got_a.any() and not got_b.any(), name


def test_adapter_memory_is_a_byte_budget_ranks_8_and_256_side_by_side(
    setup: dict[str, Any], tmp_path: Path
) -> None:
    """A replica's adapters are held within a byte budget, by their rank buckets: rank 8
    and rank 256 load side by side and decode in one batch as each does through peft; a
    load evicts the least recently used unpinned adapters until it fits, and none if that
    cannot make room; an adapter larger than the whole budget is refused by name."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(setup["path"], dtype=torch.float32).eval()
    targets = ("q_proj", "v_proj")
    ranks = {"s1": 8, "s2": 8, "s3": 8, "big": 256, "mid": 12, "huge": 300}
    for seed, (name, r) in enumerate(ranks.items()):
        save_random_lora(base, tmp_path / name, r=r, alpha=2 * r, targets=targets, seed=seed)
    # bytes per unit of rank: float32 factors of every q and v projection, in + out
    unit = 4 * sum(
        m.in_features + m.out_features
        for n, m in base.named_modules()
        if n.rpartition(".")[2] in targets
    )
    budget = (256 + 8 + 8) * unit
    lora = MultiLoraModel(base, max_adapters=8, budget_bytes=budget)
    cache = AdapterCache(lora, locate=lambda a: tmp_path / a)
    evicted: list[str] = []
    unloaded: list[str] = []
    cache.on_evict, cache.on_unload = evicted.append, unloaded.append

    def acquire(name: str, **kw: Any) -> int:
        slot = cache.acquire(name, hold=False, **kw)
        assert lora.allocated_bytes() <= budget, (name, lora.depth)
        return slot

    def held() -> dict[str, int]:
        return {e["id"]: e["bytes"] // unit for e in cache.loaded()}

    slots = {"s1": acquire("s1", pin=True), "s2": acquire("s2"), "s3": acquire("s3")}
    assert held() == {"s1": 8, "s2": 8, "s3": 8} and lora.depth == {8: 4}  # doubling
    slots["big"] = acquire("big")  # 24 + 256 > 272: the LRU unpinned s2 goes, s3 stays
    assert evicted == ["s2"] and held() == {"s1": 8, "s3": 8, "big": 256}
    assert lora.depth == {8: 2, 256: 1}  # the spare rank-8 places were given back
    assert cache.memory() == {
        "budget_bytes": budget,
        "used_bytes": budget,
        "allocated_bytes": budget,
    }

    # ranks 8 and 256 (and the bare base) in one batch, prefill and decode, each row the
    # tokens peft gives for its adapter alone; rank 256's B adds 240 to the reductions
    # of the four-projection LoRA allowance of FORWARD in each of the 2 layers
    engine = BatchEngine(lora, setup["eos"], max_batch_size=16)
    names = [None, "s1", "s3", "big"]
    pairs = [(a, p) for a in names for p in setup["prompts"]]
    items = [(p, GREEDY, slots[a] if a else 0) for a, p in pairs]
    outputs: dict[str | None, list[list[int]]] = {}
    for (a, p), got in zip(pairs, generate_all(engine, setup["tok"], items), strict=True):
        plain = AutoModelForCausalLM.from_pretrained(setup["path"], dtype=torch.float32)
        peft = double((PeftModel.from_pretrained(plain, tmp_path / a) if a else plain).eval())
        forward = FORWARD + 2 * 4 * (256 - 16)
        assert_greedy(peft, p, got.token_ids, GREEDY.max_tokens, setup["eos"], msg=(a, p),
                      forward=forward)  # fmt: skip
        outputs.setdefault(a, []).append(got.token_ids)
    assert len({json.dumps(v) for v in outputs.values()}) == len(names)

    # an adapter larger than the whole budget (rank 300 takes the 512 bucket): refused by
    # name, nothing evicted, its node-cache hold let go
    need = f"{512 * unit / 2**20:.1f} MiB"
    with pytest.raises(AdapterTooLarge, match=rf"rank 300 over 4 modules needs {need}"):
        cache.acquire("huge")
    assert held() == {"s1": 8, "s3": 8, "big": 256} and unloaded == ["s2", "huge"]

    # pinned and in-flight adapters stay: when evicting the others cannot make room,
    # none is evicted
    acquire("big", pin=True)
    with pytest.raises(CacheFullError, match=r"adapter memory .* held by pinned adapters"):
        cache.acquire("mid")  # rank 12, bucket 16: 16 + 8 + 256 > 272 even without s3
    assert held() == {"s1": 8, "s3": 8, "big": 256} and evicted == ["s2"]
    acquire("big", pin=False)
    slots["mid"] = acquire("mid")  # LRU first: s3, then big, until it fits
    assert evicted == ["s2", "s3", "big"] and held() == {"s1": 8, "mid": 16}
    assert lora.depth == {8: 1, 16: 1}  # trimmed: rank 256's place is gone


def test_unusable_adapters_are_refused_by_name(
    setup: dict[str, Any], tmp_path: Path, tiny_registry: Path
) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    _, cache = _server(setup)
    cache.locate = lambda a: tmp_path / a
    unloaded: list[str] = []
    cache.on_unload = unloaded.append
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
    assert unloaded == ["missing", "dora", "other", "deeper"]  # nor held in the node cache


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
    de-quantized base (what merged mode does with a 4-bit base) it gives the same. The
    reference: peft on the de-quantized base (the weights the NF4 forward multiplies by,
    bit for bit: the next test), in float64."""
    from peft import PeftModel

    from tunefleet.workers._nf4 import dequantize_4bit_model
    from tunefleet.workers.serve._adapters import load_serving_base

    base = load_serving_base(setup["path"], "nf4")
    assert getattr(base, "is_loaded_in_4bit", False)
    lora = MultiLoraModel(base, max_adapters=2)
    slot = AdapterCache(lora, locate=lambda a: setup["folder"] / a).acquire("a2", hold=False)
    engine = BatchEngine(lora, eos_ids(base, setup["tok"]))
    prompts = setup["prompts"][:2]
    got = generate_all(engine, setup["tok"], [(p, GREEDY, slot) for p in prompts])

    exact = dequantize_4bit_model(load_serving_base(setup["path"], "nf4"))
    reference = double(PeftModel.from_pretrained(exact, setup["folder"] / "a2").eval())

    peft = PeftModel.from_pretrained(
        load_serving_base(setup["path"], "nf4"), setup["folder"] / "a2"
    )
    merged_base = dequantize_4bit_model(lora.base_copy())
    merged = PeftModel.from_pretrained(merged_base, setup["folder"] / "a2").merge_and_unload()
    alone = BatchEngine(MultiLoraModel(merged, max_adapters=1), eos_ids(merged, setup["tok"]))
    again = generate_all(alone, setup["tok"], [(p, GREEDY, 0) for p in prompts])
    eos, n = setup["eos"], GREEDY.max_tokens
    for p, g, a in zip(prompts, got, again, strict=True):
        with torch.inference_mode():
            out = peft.generate(input_ids=torch.tensor([p]), max_new_tokens=n, do_sample=False)
        ref = [int(t) for t in out[0, len(p) :]]
        ref = next((ref[:i] for i, t in enumerate(ref) if t in eos), ref)
        assert_greedy(reference, p, g.token_ids, n, eos, msg=(p, "served on NF4"))
        assert_greedy(reference, p, ref, n, eos, msg=(p, "peft on NF4"))
        assert_greedy(reference, p, a.token_ids, n, eos, msg=(p, "merged, de-quantized"))


def test_a_4bit_base_dequantizes_into_the_weights_its_forward_multiplies_by(
    setup: dict[str, Any], tmp_path: Path
) -> None:
    """After the 4-bit base has run (where bitsandbytes would repack it for its bf16 kernel
    on an AVX512-BF16 CPU), each 4-bit layer of a de-quantized copy is an fp32 ``nn.Linear``
    holding bitsandbytes' fp32 de-quantization of its weight, bit for bit, and the copy
    gives the 4-bit model's logits within float32 rounding (two ``float64.logit_error``,
    about 4e-3; equal here), which weights rounded to bf16 do not (0.05 off); it saves and
    loads as a plain model."""
    import bitsandbytes as bnb
    from bitsandbytes.functional import dequantize_4bit
    from torch import nn
    from transformers import AutoModelForCausalLM

    from tunefleet.workers._nf4 import dequantize_4bit_model
    from tunefleet.workers.serve._adapters import load_serving_base

    nf4 = load_serving_base(setup["path"], "nf4")
    layers = {n: m for n, m in nf4.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert len(layers) == 14  # 7 per decoder block; the output layer stays fp32
    expected = {n: dequantize_4bit(m.weight.data, m.weight.quant_state) for n, m in layers.items()}
    assert {w.dtype for w in expected.values()} == {torch.float32}
    ids = torch.tensor([setup["prompts"][2]])
    with torch.inference_mode():
        logits = nf4(ids).logits
    plain = dequantize_4bit_model(copy.deepcopy(nf4))
    for name, weight in expected.items():
        layer = plain.get_submodule(name)
        assert type(layer) is nn.Linear and torch.equal(layer.weight, weight), name
    assert not getattr(plain, "is_loaded_in_4bit", False)
    assert getattr(plain, "hf_quantizer", None) is None
    assert not hasattr(plain.config, "quantization_config")
    with torch.inference_mode():
        out = plain(ids, output_hidden_states=True)
        allowed = 2 * logit_error(plain, out.hidden_states[-1][0])[:, None]
        assert ((out.logits[0] - logits[0]).abs() <= allowed).all()

    rounded = copy.deepcopy(plain)  # what de-quantizing through bf16 would give
    for name in expected:
        weight = rounded.get_submodule(name).weight
        weight.data = weight.data.to(torch.bfloat16).float()
    with torch.inference_mode():
        assert ((rounded(ids).logits[0] - logits[0]).abs() > allowed).any()

    plain.save_pretrained(tmp_path)
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.inference_mode():
        assert torch.equal(reloaded(ids).logits, plain(ids).logits)


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


def test_long_rows_cross_cache_blocks_while_others_join_and_leave(
    setup: dict[str, Any], references: dict[str | None, Any]
) -> None:
    """Rows decoding past several KV-cache blocks (``kvcache.GROW`` columns each), others
    joining with other prompt lengths and leaving early: every row gets its tokens alone."""
    engine, cache = _server(setup)
    engine.eos = set()  # run every row to its max_tokens
    long_s, short_s = Sampling(max_tokens=3 * GROW + 3, temperature=0), Sampling(5, 0)
    p = setup["prompts"]
    waves = [
        [("a1", p[2], long_s), ("a2", p[3], short_s)],
        [("a4", p[0], long_s), (None, p[1], short_s)],  # joins after 7 steps
        [("a3", p[3], Sampling(GREEDY.max_tokens, 0))],  # after 20 steps
    ]
    named = [it for wave in waves for it in wave]
    slots = {a: cache.acquire(a) if a else 0 for a, _, _ in named}
    items = [(prompt, s, slots[a]) for a, prompt, s in named]
    alone = [generate_all(engine, setup["tok"], [it])[0].token_ids for it in items]
    got: list[list[int]] = [[] for _ in items]

    def sink(i: int) -> Any:
        return lambda token, finish: token is not None and got[i].append(token)

    k = 0
    for wave, steps in zip(waves, (7, 13, 0), strict=True):
        for _ in wave:
            engine.submit(*items[k], sink(k))
            k += 1
        for _ in range(steps):
            engine.step()
    engine.run_until_idle()
    assert [len(g) for g in got] == [s.max_tokens for _, s, _ in items]
    for i, (a, prompt, s) in enumerate(named):  # no end of text: every row runs its length
        _check(setup, references, a, prompt, got[i], s, ("joined", a), eos=set())
        _check(setup, references, a, prompt, alone[i], s, ("alone", a), eos=set())


@pytest.mark.parametrize("tokens", [5, 1])  # a prefill, a decoding step
def test_each_row_gets_its_own_adapters_delta_on_every_kernel_path(tokens: int) -> None:
    """A batch over two rank buckets and the bare base: the rank-8 stack (4 places, 3 rows)
    is large beside its rows (a prefill gathers each row's factors), the rank-32 one (1
    place, 2 rows) small (a prefill multiplies the whole stack once); decoding reads the
    factors in place (embedding_bag). Each row is ``base(x) + (x @ A[place]) @ B[place]``
    of its own place, within float32 rounding of that sum in float64: each output is a
    dot product over ``in`` terms, then over R, so off by at most gamma(in + R + 1) times
    the magnitudes summed (``|x| @ |A| @ |B|`` and the base's ``|x| @ |W|``)."""
    from tunefleet.workers.serve._multilora import BatchedLoraLinear, _Rows

    torch.manual_seed(0)
    rows = _Rows()
    layer = BatchedLoraLinear(torch.nn.Linear(64, 48, bias=False), rows)
    for rank, places in ((8, 4), (32, 1)):
        layer.resize(rank, places)
        for place in range(places):
            layer.write(rank, place, torch.randn(rank - 1, 64), torch.randn(48, rank - 1))
    batch = [(8, 0), (8, 0), (32, 0), None, (8, 3), (32, 0)]
    rows.set(batch)
    x = torch.randn(len(batch), tokens, 64)
    with torch.inference_mode():
        got = layer(x)
    weight = layer.base.weight.detach()
    for row, place in enumerate(batch):
        xs = x[row].double()
        want, magnitude = xs @ weight.double().T, xs.abs() @ weight.double().abs().T
        if place is not None:
            a, b = (t.double() for t in layer.stacks[place[0]])
            a, b = a[place[1]], b[place[1]]
            want = want + (xs @ a) @ b
            magnitude = magnitude + (xs.abs() @ a.abs()) @ b.abs()
        bound = gamma(64 + 32 + 1) * magnitude
        assert ((got[row].double() - want).abs() <= bound).all(), (row, place)
    assert rows.groups[0].rank == 8 and 4 * rows.groups[0].most > 2 * 3  # gathered
    assert rows.groups[1].rank == 32 and 1 * rows.groups[1].most <= 2 * 2  # the whole stack


def test_batch_cache_writes_in_place_joins_and_selects() -> None:
    torch.manual_seed(0)

    def states(rows: int, n: int) -> torch.Tensor:
        return torch.randn(rows, 2, n, 4)

    a, b = BatchCache(), BatchCache()
    ka, kb = states(2, 5), states(3, 9)
    assert a.get_mask_sizes(5, 0) == (GROW, 0)  # what the first update returns
    keys, _ = a.update(ka, ka + 1, 0)
    b.update(kb, kb + 1, 0)
    assert keys.shape[2] == GROW and a.length == 5
    steps = [states(2, 1) for _ in range(GROW)]  # crosses a block boundary
    for step in steps:
        width = a.get_mask_sizes(1, 0)[0]
        keys, values = a.update(step, step + 1, 0)
        assert keys.shape[2] == width
    written = torch.cat([ka, *steps], dim=2)
    assert a.length == 5 + GROW and keys.shape[2] == 2 * GROW
    assert torch.equal(keys[:, :, : a.length], written)
    assert torch.equal(values[:, :, : a.length], written + 1)
    assert not keys[:, :, a.length :].any()

    a.join(b)  # b's 9 columns right-aligned with a's 21, zeros on their left
    layer = a.layers[0]
    assert a.length == 5 + GROW and layer.keys.shape[0] == 5
    assert torch.equal(layer.keys[:2, :, : a.length], written)
    assert torch.equal(layer.keys[2:, :, a.length - 9 : a.length], kb)
    assert not layer.keys[2:, :, : a.length - 9].any()

    a.select(torch.tensor([3, 0]), first=2)
    assert a.length == 3 + GROW and layer.keys.shape[0] == 2
    assert torch.equal(layer.keys[0, :, a.length - 9 : a.length], kb[1])
    assert torch.equal(layer.keys[1, :, : a.length], written[0, :, 2:])
    assert torch.equal(layer.values[1, :, : a.length], written[0, :, 2:] + 1)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied-with-biases"])
def test_linear_layers_are_packed_and_copied_back_plain(tied: bool) -> None:
    """On a CPU every linear layer (the output layer too) runs from a oneDNN-packed weight:
    the products of ``nn.Linear`` (within float32 rounding of a dot product: both are off
    by at most ``gamma(n)`` of the terms' magnitudes), a row's result the same bits
    whatever the batch (oneDNN's design; MKL's is not), and
    ``base_copy`` gives back plain layers with the same weights, a tied head still tied."""
    from torch import nn
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
        attention_bias=tied,
    )
    base = LlamaForCausalLM(config).eval()
    plain = copy.deepcopy(base)
    lora = MultiLoraModel(base, max_adapters=2)
    names = [n for n, m in plain.named_modules() if type(m) is nn.Linear]
    assert sorted(lora.packed) == sorted(names) and "lm_head" in names
    with torch.inference_mode():
        for name in names:
            layer, reference = base.get_submodule(name), plain.get_submodule(name)
            assert type(layer) is PackedLinear
            x = torch.randn(6, 3, layer.in_features)
            # a dot product of n terms, in any order: within gamma(n) of the sum of the
            # terms' magnitudes of the exact one (Higham, section 3.1); the bias one more
            n = layer.in_features + (reference.bias is not None)
            magnitude = x.double().abs() @ reference.weight.double().abs().T
            if reference.bias is not None:
                magnitude += reference.bias.double().abs()
            difference = (layer(x) - reference(x)).double().abs()
            assert (difference <= 2 * gamma(n) * magnitude).all(), name
            assert torch.equal(layer(x)[:1], layer(x[:1]))
    copied = lora.base_copy()
    for name in names:
        layer, reference = copied.get_submodule(name), plain.get_submodule(name)
        assert type(layer) is nn.Linear
        assert torch.equal(layer.weight, reference.weight)
        assert (layer.bias is None) == (reference.bias is None)
    assert (copied.lm_head.weight is copied.model.embed_tokens.weight) == tied
    assert pack_linear(nn.Linear(4, 4).to(torch.float64)) is None  # fp32, bf16 only


@pytest.mark.skipif(not cpu_bf16()[0], reason=f"bf16 is not native here: {cpu_bf16()[1]}")
def test_bf16_linear_layers_are_packed_where_bf16_is_native() -> None:
    """A base served in bf16 (``TUNEFLEET_SERVE_PRECISION=auto`` on a native-bf16 CPU)
    has its layers packed for oneDNN too. Both the packed product and ``nn.Linear``'s
    multiply bf16 values exactly in fp32, sum in fp32 (within ``gamma(n)`` of the terms'
    magnitudes, fp32's unit roundoff) and round the sum to bf16 once (within 2^-8 of it):
    each within that of the exact product, so within twice of each other."""
    from torch import nn

    torch.manual_seed(0)
    plain = nn.Linear(256, 96).to(torch.bfloat16)
    packed = pack_linear(plain)
    assert type(packed) is PackedLinear
    x = torch.randn(5, 7, 256).to(torch.bfloat16)
    exact = x.double() @ plain.weight.double().T + plain.bias.double()
    magnitude = x.double().abs() @ plain.weight.double().abs().T + plain.bias.double().abs()
    bound = 2 * (gamma(257) * magnitude + 2.0**-8 * exact.abs())
    with torch.inference_mode():
        assert packed(x).dtype == torch.bfloat16
        assert ((packed(x).double() - plain(x).double()).abs() <= bound).all()


def test_a_slow_adapter_read_holds_up_no_loaded_adapter(setup: dict[str, Any]) -> None:
    """acquire held the cache's lock while it read an adapter's files: a slow disk (a
    network volume) held up every request, those of loaded adapters too. An adapter in
    use is refused unloading as in use (it was reported as a full cache)."""
    import threading

    _, cache = _server(setup, max_adapters=4)
    cache.acquire("a1", hold=False)
    locate, reading, release = cache.locate, threading.Event(), threading.Event()

    def slow_disk(adapter_id: str) -> Path:
        if adapter_id == "a2":
            reading.set()
            release.wait(30)
        return Path(locate(adapter_id))

    cache.locate = slow_disk
    loading = threading.Thread(target=cache.acquire, args=("a2",), kwargs={"hold": False})
    loading.start()
    assert reading.wait(10)
    cache.acquire("a1")
    # no clock: answered while a2 is still being read (its read waits up to 30 s for the
    # release; an acquire that waited for it would return only after that read ended)
    assert loading.is_alive() and not release.is_set()
    with pytest.raises(AdapterInUse, match="1 request"):
        cache.unload("a1")
    release.set()
    loading.join(10)
    assert {e["id"] for e in cache.loaded()} == {"a1", "a2"}
