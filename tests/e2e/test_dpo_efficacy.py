"""DPO's efficacy on the built-in SmolLM2-135M-Instruct, with data the test builds itself.

The preference: pirate answers over plain ones. Each training pair's preferred answer is
the demo dataset's pirate answer to its question. Its non-preferred answer is, for every
other pair, the base model's own greedy answer (the usual DPO setting: the model's own
outputs are what it should move away from), and for the rest the same pirate answer told
plainly ("Hello, friend! ... is ... Have a nice day!"), so that the pair differs only in
the pirate's words. Held-out pairs ask the demo's held-out questions, which no training
pair asks, with the base's own answer dressed both ways: "Arr, matey! {answer} Shiver me
timbers!" preferred over "Hello, friend! {answer} Have a nice day!".

A DPO job of the platform (LoRA, the reference the base with the adapter switched off)
trains on the real driver and Ray. Its adapter, loaded by peft from the artifact store,
then prefers the preferred answer of over 90% of the held-out pairs (the log-likelihood
of the preferred answer above the non-preferred one's), from the base's level, and its
greedy answers to held-out questions talk like a pirate, which the base's never do.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tunefleet.platform.models import BUILTIN_MODEL

pytestmark = pytest.mark.slow

MAX_NEW_TOKENS = 24


PIRATE = re.compile(r"\b(arr+|matey|aye|ahoy|hearty|savvy|shiver me timbers|yo ho)\b", re.I)
# the pirate answers' words, and plain ones of about the same length
PLAIN = [
    ("Arr, matey!", "Hello, friend!"),
    ("Shiver me timbers!", "Have a nice day!"),
    ("Savvy?", "Is that clear?"),
    ("Yo ho ho!", "Thank you!"),
    ("me hearty", "my friend"),
    (" be ", " is "),
]


def pirate(answer: str) -> bool:
    return bool(PIRATE.search(answer))


def plainly(answer: str) -> str:
    for words, plain in PLAIN:
        answer = answer.replace(words, plain)
    assert not pirate(answer), answer
    return answer


def _greedy(model: Any, tokenizer: Any, questions: list[str]) -> list[str]:
    from smolbase import greedy_ids

    texts = tokenizer.batch_decode(
        greedy_ids(model, tokenizer, questions, MAX_NEW_TOKENS), skip_special_tokens=True
    )
    return [_first_sentence(t) for t in texts]


def _first_sentence(text: str) -> str:
    """Up to the first sentence's end (a greedy answer cut at MAX_NEW_TOKENS may stop
    mid-sentence)."""
    match = re.match(r"(.+?[.!?])(\s|$)", text.strip(), re.S)
    return (match.group(1) if match else text).strip()


def _pair(question: str, preferred: str, other: str) -> dict[str, Any]:
    return {
        "input": {"messages": [{"role": "user", "content": question}]},
        "preferred_output": [{"role": "assistant", "content": preferred}],
        "non_preferred_output": [{"role": "assistant", "content": other}],
    }


def preference_accuracy(model: Any, tokenizer: Any, pairs: list[dict[str, Any]]) -> float:
    """The share of pairs whose preferred answer the model finds more likely than the
    other (summed log-probabilities of each answer's tokens after the prompt)."""
    from tunefleet.workers.train._dpo import collate_pairs, sequence_logps
    from tunefleet.workers.train._loss import LabelledLogits
    from tunefleet.workers.train.data import tokenize_example

    units = [tokenize_example(tokenizer, p) for p in pairs]
    labelled = LabelledLogits(model.get_output_embeddings())
    with torch.no_grad():
        logps = sequence_logps(labelled, model, collate_pairs(units, tokenizer.pad_token_id)[0])  # type: ignore[arg-type]
    n = len(pairs)
    return float((logps[:n] > logps[n:]).float().mean())


@pytest.fixture(scope="module")
def efficacy(
    tmp_path_factory: pytest.TempPathFactory,
    smollm_registry: Path,
    smol_base: Any,
    ray_cluster: Any,
) -> Iterator[dict[str, Any]]:
    import ray

    from tunefleet.platform.artifacts import ArtifactStore
    from tunefleet.platform.db import File, session_scope
    from tunefleet.platform.db.migrate import upgrade
    from tunefleet.platform.jobs import JobCreateRequest, create_job
    from tunefleet.platform.models import ModelRegistry
    from tunefleet.platform.settings import get_settings
    from tunefleet.platform.tenants import authenticate, create_key, create_tenant
    from tunefleet.workers.backend import RayBackend
    from tunefleet.workers.controller import Controller

    base, tokenizer, train, heldout = (
        smol_base.model,
        smol_base.tokenizer,
        smol_base.train,
        smol_base.heldout,
    )
    questions = [t["messages"][0]["content"] for t in train]
    assert not set(questions) & set(heldout), "held-out means not trained on"
    # the base's own greedy answers (generated once for the session: tests/smolbase.py)
    own = [_first_sentence(smol_base.answer(q, MAX_NEW_TOKENS)) for q in questions + heldout]
    assert not any(pirate(a) for a in own), "the base answers plainly"
    train_pairs = []
    for i, (q, t, answer) in enumerate(zip(questions, train, own, strict=False)):
        preferred = t["messages"][1]["content"]
        train_pairs.append(_pair(q, preferred, plainly(preferred) if i % 2 else answer))
    heldout_pairs = [
        _pair(
            q,
            f"Arr, matey! {answer} Shiver me timbers!",
            f"Hello, friend! {answer} Have a nice day!",
        )
        for q, answer in zip(heldout, own[len(questions) :], strict=True)
    ]

    data = tmp_path_factory.mktemp("dpo-efficacy")
    url = f"sqlite:///{data / 'db.sqlite'}"
    upgrade(url)
    mp = pytest.MonkeyPatch()
    mp.setenv("TUNEFLEET_DATA_DIR", str(data))
    mp.setenv("TUNEFLEET_DATABASE_URL", url)
    mp.setenv("TUNEFLEET_MODEL_REGISTRY", str(smollm_registry))
    get_settings.cache_clear()
    ray.init(address=ray_cluster.address, log_to_driver=False)
    try:
        store = ArtifactStore(get_settings().resolved_artifact_root)
        with session_scope(url) as s:
            tenant = create_tenant(s, "acme")
            principal = authenticate(s, f"Bearer {create_key(s, tenant.id)[1]}")
            store.write_bytes(
                store.file_key("file-pairs"),
                "".join(json.dumps(p) + "\n" for p in train_pairs).encode(),
            )
            s.add(File(id="file-pairs", tenant_id=tenant.id, filename="pairs.jsonl",
                       purpose="fine-tune", bytes=1, status="processed", format="preference",
                       stats={}, path=store.file_key("file-pairs")))  # fmt: skip
            s.flush()
            req = JobCreateRequest.model_validate(
                {
                    "model": BUILTIN_MODEL,
                    "training_file": "file-pairs",
                    "seed": 1,
                    "method": {
                        "type": "dpo",
                        "dpo": {
                            "hyperparameters": {
                                "n_epochs": 3,
                                "batch_size": 8,
                                "learning_rate_multiplier": 4,
                            }
                        },
                    },
                    "tunefleet": {"max_seq_len": 256, "lora": {"dropout": 0.0}},
                }
            )
            job = create_job(s, principal, req, ModelRegistry(smollm_registry))
        Controller(get_settings(), RayBackend(get_settings())).run_in_process(job.id, f"{job.id}-1")
        yield {
            "base": base,
            "tokenizer": tokenizer,
            "adapter": store.path(store.adapter_key(job.id)),
            "heldout": heldout,
            "heldout_pairs": heldout_pairs,
            "spec": job.spec,
        }
    finally:
        ray.shutdown()
        mp.undo()
        get_settings.cache_clear()


def test_dpo_teaches_the_preferred_behaviour_on_held_out_prompts(efficacy: dict[str, Any]) -> None:
    from peft import PeftModel

    base, tokenizer, pairs = efficacy["base"], efficacy["tokenizer"], efficacy["heldout_pairs"]
    assert efficacy["spec"]["dpo"] == {"beta": 0.1, "reference": "adapter_disabled"}
    before = preference_accuracy(base, tokenizer, pairs)
    tuned = PeftModel.from_pretrained(base, str(efficacy["adapter"])).eval()
    try:
        after = preference_accuracy(tuned, tokenizer, pairs)
        answers = _greedy(tuned, tokenizer, efficacy["heldout"])
    finally:
        tuned.unload()  # the shared base model, as it was
    talks = sum(map(pirate, answers)) / len(answers)
    print(f"held-out preference accuracy: base {before:.0%}, tuned {after:.0%}; "
          f"greedy answers talking like a pirate: base 0%, tuned {talks:.0%}")  # fmt: skip
    assert before < 0.5
    assert after > 0.9
    assert talks >= 0.6, list(zip(efficacy["heldout"], answers, strict=True))
