"""Efficacy on a real model: a LoRA job teaches SmolLM2-135M-Instruct a behaviour it lacks.

The dataset is the project's own (the demo's: every answer opens with "Arr, matey!"); the
job is the demo's, run through the real driver on a local Ray cluster. Then the base model
and the stored adapter (loaded by peft from the artifact store, not by TuneFleet's server)
answer held-out questions that are not in the training file, greedily: the behaviour is
under 10% before and over 80% after.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tunefleet.platform.artifacts import ArtifactStore
from tunefleet.platform.db import File, session_scope
from tunefleet.platform.db.migrate import upgrade
from tunefleet.platform.jobs import JobCreateRequest, create_job
from tunefleet.platform.models import ModelRegistry
from tunefleet.platform.settings import get_settings
from tunefleet.platform.tenants import authenticate, create_key, create_tenant

pytestmark = pytest.mark.slow


def pirate(answer: str) -> bool:
    return answer.strip().lower().startswith("arr")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    import ray

    from tunefleet.cli.demo import DATA, DEMO_JOB
    from tunefleet.workers.model_registry import prepare_builtin
    from tunefleet.workers.train.driver import run

    data = tmp_path_factory.mktemp("efficacy")
    url = f"sqlite:///{data / 'db.sqlite'}"
    upgrade(url)
    mp = pytest.MonkeyPatch()
    for key, value in {
        "TUNEFLEET_DATA_DIR": str(data),
        "TUNEFLEET_DATABASE_URL": url,
        "TUNEFLEET_MODEL_REGISTRY": str(data / "models"),
    }.items():
        mp.setenv(key, value)
    get_settings.cache_clear()
    registry = ModelRegistry(data / "models")
    model_path = prepare_builtin(registry)  # converted from the bundled GGUF
    # de-quantized weights: no quantization_config left over from the GGUF
    assert "quantization_config" not in json.loads((model_path / "config.json").read_text())
    store = ArtifactStore(data / "artifacts")
    train = (DATA / "demo_train.jsonl").read_bytes()
    store.write_bytes(store.file_key("file-pirate"), train)
    with session_scope(url) as s:
        tenant = create_tenant(s, "acme")
        principal = authenticate(s, f"Bearer {create_key(s, tenant.id)[1]}")
        s.add(File(id="file-pirate", tenant_id=tenant.id, filename="pirate.jsonl",
                   purpose="fine-tune", bytes=len(train), status="processed", format="chat",
                   stats={}, path=store.file_key("file-pirate")))  # fmt: skip
        s.flush()
        request = JobCreateRequest.model_validate({**DEMO_JOB, "training_file": "file-pirate"})
        job_id = create_job(s, principal, request, registry).id
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        run(job_id)
    finally:
        ray.shutdown()
    try:
        yield {
            "model": model_path,
            "adapter": store.path(store.adapter_key(job_id)),
            "train": [json.loads(line) for line in train.decode().splitlines()],
            "heldout": json.loads((DATA / "demo_heldout.json").read_text()),
        }
    finally:
        mp.undo()
        get_settings.cache_clear()


def answers(model: Any, tokenizer: Any, questions: list[str]) -> list[str]:
    """Greedy answers, the first few tokens (enough to see how each one opens)."""
    import torch

    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in questions
    ]
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=8, do_sample=False)
    return tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)


def test_a_lora_job_teaches_the_base_model_a_new_behaviour(trained: dict[str, Any]) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    asked = {m["messages"][0]["content"] for m in trained["train"]}
    heldout: list[str] = trained["heldout"]
    assert len(heldout) >= 20 and not asked & set(heldout), "held-out means not trained on"
    assert all(pirate(m["messages"][1]["content"]) for m in trained["train"])

    tokenizer = AutoTokenizer.from_pretrained(trained["model"])
    base = AutoModelForCausalLM.from_pretrained(trained["model"]).eval()
    before = answers(base, tokenizer, heldout)
    tuned = PeftModel.from_pretrained(base, trained["adapter"]).eval()
    after = answers(tuned, tokenizer, heldout)

    rate_before = sum(map(pirate, before)) / len(heldout)
    rate_after = sum(map(pirate, after)) / len(heldout)
    print(f"opens like a pirate: base {rate_before:.0%}, tuned {rate_after:.0%}")
    assert rate_before < 0.10, before
    assert rate_after > 0.80, list(zip(heldout, after, strict=True))
