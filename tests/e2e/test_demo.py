"""The README's first command, `make demo` (`tunefleet demo`), run whole on the session's Ray
cluster, and what it shows checked twice:

- the demo itself: the stack on the built-in SmolLM2-135M-Instruct, the bundled dataset
  uploaded, the LoRA job followed with live progress, held-out questions answered by the
  base model and by the adapter through /v1/chat/completions (TuneFleet's server);
- efficacy: the adapter the demo stored, loaded by peft from the artifact store (not by
  TuneFleet's server), answers held-out questions that are not in the training file,
  greedily, with the dataset's behaviour ("Arr, matey!") under 10% of the time before and
  over 80% after.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from raycluster import free_port
from tunefleet.platform.models import BUILTIN_MODEL
from tunefleet.workers._precision import cpu_bf16

pytestmark = pytest.mark.slow

QUESTIONS = 3  # asked through the server by the demo (the efficacy test asks all)
OPENING_TOKENS = 8
NATIVE_BF16 = cpu_bf16()[0]  # what precision "auto" trains the demo in here


def pirate(answer: str) -> bool:
    return answer.strip().lower().startswith("arr")


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory, smollm_registry: Path, ray_cluster: Any) -> Any:
    data = tmp_path_factory.mktemp("demo")
    env = {
        **os.environ,
        **ray_cluster.env(),
        "TUNEFLEET_DATA_DIR": str(data),
        "TUNEFLEET_MODEL_REGISTRY": str(smollm_registry),
        "TUNEFLEET_API_PORT": str(free_port()),
        "TUNEFLEET_SERVE_PORT": str(free_port()),
        "TUNEFLEET_CONTROLLER_INTERVAL_S": "0.3",
        "TUNEFLEET_SERVE_PRECISION": "auto",  # the default (the other tests serve fp32)
    }
    run = subprocess.run(
        [sys.executable, "-m", "tunefleet.cli.main", "demo", "--questions", str(QUESTIONS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    return run, data


def test_the_demo_trains_and_compares_answers(demo: Any) -> None:
    run, _ = demo
    out = run.stdout
    assert run.returncode == 0, (out[-3000:], run.stderr[-3000:])
    assert re.search(r"^Uploaded file-\S+: \d+ examples$", out, re.M), out
    job = re.search(rf"^Created (ftjob-\S+) on {BUILTIN_MODEL}$", out, re.M)
    assert job, out
    assert "[info] Training 30 steps of lora" in out  # the live progress's messages
    # in the precision "auto" settles on this CPU, with its reason
    assert f" in {'bf16' if NATIVE_BF16 else 'fp32'} (auto: this CPU " in out, out
    tuned = f"ft:{BUILTIN_MODEL}:demo:pirate:{job.group(1)}"
    assert f"Held-out questions, base {BUILTIN_MODEL} vs {tuned}:" in out
    answers = re.findall(r"^Q: (.+)\n  base : (.*)\n  tuned: (.*)$", out, re.M)
    assert len(answers) == QUESTIONS and all(base and ft for _, base, ft in answers), out
    served = re.search(rf"^(\d)/{QUESTIONS} tuned answers speak like a pirate", out, re.M)
    assert served, out
    # the adapter served by TuneFleet answers like the one peft loads (efficacy test below)
    assert int(served.group(1)) >= QUESTIONS - 1, answers


def test_the_demo_adapter_teaches_the_base_model_a_new_behaviour(demo: Any, smol_base: Any) -> None:
    from peft import PeftModel

    from smolbase import greedy_ids

    run, data = demo
    assert run.returncode == 0, run.stderr[-3000:]
    job_id = re.search(r"^Created (ftjob-\S+) on ", run.stdout, re.M).group(1)  # type: ignore[union-attr]
    adapter = data / "artifacts" / "adapters" / job_id
    # converted from the bundled GGUF to plain fp32 weights: no quantization_config left
    assert "quantization_config" not in json.loads((smol_base.path / "config.json").read_text())

    train, heldout = smol_base.train, smol_base.heldout
    asked = {m["messages"][0]["content"] for m in train}
    assert len(heldout) >= 20 and not asked & set(heldout), "held-out means not trained on"
    assert all(pirate(m["messages"][1]["content"]) for m in train)

    # greedy answers, the first few tokens (enough to see how each one opens); the base's
    # are the ones the DPO efficacy test reads too (tests/smolbase.py)
    before = [smol_base.answer(q, OPENING_TOKENS) for q in heldout]
    tuned = PeftModel.from_pretrained(smol_base.model, adapter).eval()
    try:
        ids = greedy_ids(tuned, smol_base.tokenizer, heldout, OPENING_TOKENS)
        if NATIVE_BF16:  # and in bf16, as precision auto computes and serves here
            _same_answers_in_bf16(tuned, smol_base.tokenizer, heldout, ids)
            _served_answers_in_bf16(tuned, smol_base, adapter, ids)
    finally:
        tuned.unload()  # the shared base model, as it was
    after = smol_base.tokenizer.batch_decode(ids, skip_special_tokens=True)

    rate_before = sum(map(pirate, before)) / len(heldout)
    rate_after = sum(map(pirate, after)) / len(heldout)
    print(f"opens like a pirate: base {rate_before:.0%}, tuned {rate_after:.0%}")
    assert rate_before < 0.10, before
    assert rate_after > 0.80, list(zip(heldout, after, strict=True))


def _served_answers_in_bf16(tuned: Any, smol_base: Any, adapter: Path, fp32: Any) -> None:
    """The serving engine, its base stored in bf16 as ``TUNEFLEET_SERVE_PRECISION=auto``
    serves it here (oneDNN-packed bf16 layers, the adapter's factors in fp32), answers as
    fp32 greedy does (each answer up to its end of text), with the bound of
    ``_same_answers_in_bf16``: where an answer parts, fp32's margin between the two tokens
    is within twice the largest difference between the engine's logits and fp32's there."""
    import torch

    from tunefleet.workers.serve._adapter_cache import AdapterCache
    from tunefleet.workers.serve._adapters import load_serving_base
    from tunefleet.workers.serve._engine import BatchEngine, generate_all
    from tunefleet.workers.serve._generate import Sampling, eos_ids
    from tunefleet.workers.serve._multilora import MultiLoraModel

    tokenizer, questions = smol_base.tokenizer, smol_base.heldout
    base = load_serving_base(smol_base.path, dtype=torch.bfloat16)
    assert base.lm_head.weight.dtype == torch.bfloat16
    lora = MultiLoraModel(base, max_adapters=1)
    assert lora.packed, "no layer was packed for oneDNN in bf16"
    slot = AdapterCache(lora, locate=lambda _: adapter).acquire("demo", hold=False)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=True, add_generation_prompt=True,
            return_dict=True,
        )["input_ids"]
        for q in questions
    ]  # fmt: skip
    engine = BatchEngine(lora, set(), max_batch_size=len(prompts))  # every answer its length
    sampling = Sampling(max_tokens=OPENING_TOKENS, temperature=0)
    done = generate_all(engine, tokenizer, [(p, sampling, slot) for p in prompts])
    ends = eos_ids(base, tokenizer)
    parted = 0
    for prompt, finished, exact_ids in zip(prompts, done, fp32.tolist(), strict=True):
        cut = next((i + 1 for i, t in enumerate(exact_ids) if t in ends), len(exact_ids))
        served, exact_ids = finished.token_ids[:cut], exact_ids[:cut]
        if served == exact_ids:
            continue
        parted += 1
        at = next(i for i, (a, b) in enumerate(zip(served, exact_ids, strict=True)) if a != b)
        ids = torch.tensor([prompt + exact_ids[:at]])
        with torch.no_grad():
            exact = tuned(input_ids=ids).logits[0, -1].float()
            with lora.lock:
                lora.set_rows([slot])
                rounded = lora.model(input_ids=ids).logits[0, -1].float()
                lora.set_rows(None)
        margin = exact[exact_ids[at]] - exact[served[at]]
        noise = (rounded - exact).abs().max()
        assert 0 <= margin <= 2 * noise, (tokenizer.decode(prompt), at, float(margin), float(noise))
    print(f"served in bf16: {len(prompts) - parted}/{len(prompts)} answers as in fp32")
    assert parted <= len(prompts) // 4
    answers = [tokenizer.decode(f.token_ids, skip_special_tokens=True) for f in done]
    assert sum(map(pirate, answers)) / len(answers) > 0.80, answers


def _same_answers_in_bf16(model: Any, tokenizer: Any, questions: list[str], fp32: Any) -> None:
    """Greedy answers under bf16 autocast are fp32's, except where fp32 itself nearly
    ties: at the first token where an answer parts, fp32's margin between its token and
    bf16's is within the bf16 rounding of the logits there (the largest logit difference
    between the two at that position, twice: each of the two logits may move by it). At
    most a quarter of the answers may part, and the tuned behaviour holds in bf16."""
    import torch

    from smolbase import greedy_ids

    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = greedy_ids(model, tokenizer, questions, OPENING_TOKENS)
    parted = [i for i in range(len(questions)) if not torch.equal(bf16[i], fp32[i])]
    for i in parted:
        at = int((bf16[i] != fp32[i]).nonzero()[0])
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": questions[i]}], tokenize=True,
            add_generation_prompt=True, return_tensors="pt", return_dict=True,
        )["input_ids"]  # fmt: skip
        ids = torch.cat([prompt[0], fp32[i][:at]])[None]
        with torch.no_grad():
            exact = model(input_ids=ids).logits[0, -1].float()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                rounded = model(input_ids=ids).logits[0, -1].float()
        margin = exact[fp32[i][at]] - exact[bf16[i][at]]
        noise = (rounded - exact).abs().max()
        assert 0 <= margin <= 2 * noise, (questions[i], at, float(margin), float(noise))
    print(f"bf16 greedy answers: {len(questions) - len(parted)}/{len(questions)} as in fp32")
    assert len(parted) <= len(questions) // 4, parted
    answers = tokenizer.batch_decode(bf16, skip_special_tokens=True)
    assert sum(map(pirate, answers)) / len(questions) > 0.80, answers
