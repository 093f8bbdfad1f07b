"""POST /v1/plans and the plan stored on a job; counts agree with peft's own."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from conftest import TINY, upload_chat
from conftest import auth as H
from tunefleet.platform.settings import Settings


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

    # ~6 MiB per worker: batch 1 fits only with gradient checkpointing; 4 accumulation steps
    tight = _client_with_device(settings, 0.006)
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
    tight = _client_with_device(settings, 0.006)
    body = {"model": TINY, "training_file": _upload(tight, key_a), "seed": 5}
    dry = tight.post("/v1/plans", headers=H(key_a), json=body).json()
    job = tight.post("/v1/fine_tuning/jobs", headers=H(key_a), json=body).json()
    assert job["tunefleet"]["gradient_checkpointing"] is True
    assert dry == job["tunefleet"]["plan"] and dry["advice"]["fits"]
