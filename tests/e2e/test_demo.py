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

pytestmark = pytest.mark.slow

QUESTIONS = 3  # asked through the server by the demo (the efficacy test asks all)
OPENING_TOKENS = 8


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
    finally:
        tuned.unload()  # the shared base model, as it was
    after = smol_base.tokenizer.batch_decode(ids, skip_special_tokens=True)

    rate_before = sum(map(pirate, before)) / len(heldout)
    rate_after = sum(map(pirate, after)) / len(heldout)
    print(f"opens like a pirate: base {rate_before:.0%}, tuned {rate_after:.0%}")
    assert rate_before < 0.10, before
    assert rate_after > 0.80, list(zip(heldout, after, strict=True))
