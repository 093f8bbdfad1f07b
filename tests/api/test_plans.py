"""POST /v1/plans and the plan stored on a job; counts agree with peft's own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from conftest import TINY, upload_chat
from conftest import auth as H
from tunefleet.platform import _defaults as defaults
from tunefleet.platform.settings import Settings
from tunefleet.platform.spec import AUTO_PRECISION


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ["all-linear"]])
def test_plan_counts_agree_with_peft(
    app_client: TestClient, key_a: str, tiny_registry: Path, targets: list[str]
) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    body = {
        "model": TINY,
        "training_file": "file-unused",
        "tunefleet": {"lora": {"r": 4, "target_modules": targets}},
    }
    plan = app_client.post("/v1/plans", headers=H(key_a), json=body).json()
    model = AutoModelForCausalLM.from_pretrained(tiny_registry / TINY)
    peft_model = get_peft_model(
        model,
        LoraConfig(
            r=4,
            target_modules=targets[0] if targets == ["all-linear"] else targets,
            task_type="CAUSAL_LM",
        ),
    )
    trainable, total = peft_model.get_nb_trainable_parameters()
    assert (plan["parameters"]["trainable"], plan["parameters"]["total"]) == (trainable, total)
    assert plan["object"] == "fine_tuning.plan" and plan["advice"]["fits"]
    assert plan["breakdown"]["total"] > plan["breakdown"]["states"] > 0


def test_plan_errors_and_the_plan_stored_on_a_job(app_client: TestClient, key_a: str) -> None:
    bad = app_client.post(
        "/v1/plans", headers=H(key_a), json={"model": "nope", "training_file": "f"}
    )
    assert bad.status_code == 400 and TINY in bad.json()["error"]["message"]
    small = app_client.post(
        "/v1/plans",
        headers=H(key_a),
        json={
            "model": TINY,
            "training_file": "f",
            "device_memory_gb": 0.001,
            "host_memory_gb": 0.001,
        },
    ).json()
    assert not small["advice"]["fits"]
    assert any("would fit with" in r for r in small["advice"]["reasons"])

    f = upload_chat(app_client, key_a)
    job = app_client.post(
        "/v1/fine_tuning/jobs", headers=H(key_a), json={"model": TINY, "training_file": f["id"]}
    ).json()
    stored = job["tunefleet"]["plan"]
    assert stored["input"]["per_device_batch"] == 4 and stored["input"]["seq_len"] == 512
    assert stored["breakdown"]["total"] > 0


def _client_with_device(settings: Settings, gib: float) -> TestClient:
    from tunefleet.api import create_app

    return TestClient(create_app(settings.model_copy(update={"device_memory_gb": gib})))


def _upload(client: TestClient, key: str) -> str:
    return str(upload_chat(client, key)["id"])


def test_auto_settings_follow_the_chart(settings: Settings, key_a: str) -> None:
    roomy = _client_with_device(settings, 80)
    f = _upload(roomy, key_a)
    job = roomy.post(
        "/v1/fine_tuning/jobs", headers=H(key_a), json={"model": TINY, "training_file": f}
    ).json()
    assert job["tunefleet"]["gradient_checkpointing"] is False
    assert job["tunefleet"]["micro_batch_size"] == 4  # the whole global batch at once

    # ~7 MiB per worker: batch 1 fits only with gradient checkpointing; 4 accumulation steps
    tight = _client_with_device(settings, 0.007)
    job = tight.post(
        "/v1/fine_tuning/jobs", headers=H(key_a), json={"model": TINY, "training_file": f}
    ).json()
    assert job["tunefleet"]["gradient_checkpointing"] is True
    assert job["tunefleet"]["micro_batch_size"] == 1
    advice = job["tunefleet"]["plan"]["advice"]
    assert advice["gradient_accumulation_steps"] == 4 and advice["fits"]
    # an explicit choice is kept
    job = tight.post(
        "/v1/fine_tuning/jobs",
        headers=H(key_a),
        json={
            "model": TINY,
            "training_file": f,
            "tunefleet": {"gradient_checkpointing": False, "micro_batch_size": 2},
        },
    ).json()
    assert job["tunefleet"]["gradient_checkpointing"] is False
    assert job["tunefleet"]["micro_batch_size"] == 2


def test_a_job_that_cannot_fit_is_refused_with_what_would_be_needed(
    settings: Settings, key_a: str
) -> None:
    client = _client_with_device(settings, 0.0001)
    f = _upload(client, key_a)
    resp = client.post(
        "/v1/fine_tuning/jobs", headers=H(key_a), json={"model": TINY, "training_file": f}
    )
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["code"] == "does_not_fit" and "would fit with" in err["message"]
    assert client.get("/v1/fine_tuning/jobs", headers=H(key_a)).json()["data"] == []


def test_the_dry_run_shows_the_plan_the_job_stores(settings: Settings, key_a: str) -> None:
    """POST /v1/plans built its own spec and skipped the planner's settling: on a tight
    device it showed the ``auto`` job as DDP without checkpointing at the whole batch, a
    plan that does not fit, while the job runs with checkpointing at micro-batch 1. Now it
    is the plan job creation stores."""
    tight = _client_with_device(settings, 0.007)
    body = {"model": TINY, "training_file": _upload(tight, key_a), "seed": 5}
    dry = tight.post("/v1/plans", headers=H(key_a), json=body).json()
    job = tight.post("/v1/fine_tuning/jobs", headers=H(key_a), json=body).json()
    assert job["tunefleet"]["gradient_checkpointing"] is True
    chart = dry.pop("chart")  # the dry run adds the seeds' chart to the plan
    assert dry == job["tunefleet"]["plan"] and dry["advice"]["fits"]
    # the chart walks the seeds' steps at the plan's micro-batch; the settled one is on it
    steps = [(c["strategy"], c["gradient_checkpointing"]) for c in chart]
    assert steps == [("ddp", False), ("ddp", True), ("zero3", True), ("zero3_offload", True)]
    settled = chart[1]["breakdown"]
    assert settled == dry["breakdown"] and chart[1]["fits"]
    assert chart[0]["breakdown"]["activations"] > settled["activations"]


def test_auto_hyperparameters_follow_the_training_file_and_say_so(
    settings: Settings, key_a: str
) -> None:
    """Epochs and batch size "auto" follow the file's size, the learning rate the model's
    width: the job shows what they settled on, its first event says why, and the dry run
    of the same body (with the same file) plans the same batch."""
    client = _client_with_device(settings, 80)
    rows = "".join(
        json.dumps({"messages": [{"role": "user", "content": f"q{i}"},
                                 {"role": "assistant", "content": f"a{i}"}]}) + "\n"
        for i in range(300)
    )  # fmt: skip
    resp = client.post("/v1/files", headers=H(key_a), data={"purpose": "fine-tune"},
                       files={"file": ("big.jsonl", rows.encode())})  # fmt: skip
    assert resp.status_code == 200, resp.text
    big, small = resp.json()["id"], _upload(client, key_a)  # 300 examples, and one

    job = client.post(
        "/v1/fine_tuning/jobs", headers=H(key_a), json={"model": TINY, "training_file": big}
    ).json()
    assert job["hyperparameters"] == {"n_epochs": 3, "batch_size": 8,
                                      "learning_rate_multiplier": 1.0}  # fmt: skip
    rate = defaults.base_learning_rate("lora", json.loads((settings.resolved_model_registry
                                       / TINY / "config.json").read_text()))[0]  # fmt: skip
    assert job["tunefleet"]["learning_rate"] == pytest.approx(rate)
    events = client.get(f"/v1/fine_tuning/jobs/{job['id']}/events", headers=H(key_a)).json()
    first = events["data"][-1]
    assert "auto settled n_epochs 3 (300 examples); batch_size 8" in first["message"], first
    assert first["data"]["auto"].keys() == {
        "n_epochs", "batch_size", "learning_rate_multiplier", "precision"
    }  # fmt: skip
    # precision: the workers settle it, the plan is for what CPU workers may choose
    planned = job["tunefleet"]["plan"]["input"]["precision"]
    assert first["data"]["auto"]["precision"] == f"{AUTO_PRECISION}; planned as {planned}"
    assert f"; precision auto ({AUTO_PRECISION}; planned as {planned})" in first["message"]
    plan = client.post(
        "/v1/plans", headers=H(key_a), json={"model": TINY, "training_file": big}
    ).json()
    assert plan.pop("chart") and plan == job["tunefleet"]["plan"]  # the dry run adds the chart

    # one example: more epochs (OpenAI's rule: at least 100 seen), the smallest batch
    job = client.post(
        "/v1/fine_tuning/jobs", headers=H(key_a), json={"model": TINY, "training_file": small}
    ).json()
    assert job["hyperparameters"]["n_epochs"] == defaults.MAX_EPOCHS
    assert job["hyperparameters"]["batch_size"] == defaults.MIN_BATCH
    # what was set is kept, and said nowhere as auto; the multiplier scales the same rate
    job = client.post(
        "/v1/fine_tuning/jobs",
        headers=H(key_a),
        json={"model": TINY, "training_file": big,
              "hyperparameters": {"n_epochs": 2, "batch_size": 2,
                                  "learning_rate_multiplier": 0.5},
              "tunefleet": {"precision": "fp32"}},
    ).json()  # fmt: skip
    assert job["hyperparameters"] == {"n_epochs": 2, "batch_size": 2,
                                      "learning_rate_multiplier": 0.5}  # fmt: skip
    assert job["tunefleet"]["learning_rate"] == pytest.approx(rate * 0.5)
    events = client.get(f"/v1/fine_tuning/jobs/{job['id']}/events", headers=H(key_a)).json()
    assert "auto" not in events["data"][-1]["message"]
