"""The official `openai` SDK drives TuneFleet (in-process, through the ASGI app)."""

from __future__ import annotations

import json
import re

import openai
import pytest
from fastapi.testclient import TestClient
from openai import OpenAI

CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}


@pytest.fixture
def sdk(app_client: TestClient, key_a: str) -> OpenAI:
    return OpenAI(
        base_url="http://testserver/v1", api_key=key_a, http_client=app_client, max_retries=0
    )


def test_sdk_covers_the_fine_tuning_api(sdk: OpenAI) -> None:
    f = sdk.files.create(
        file=("train.jsonl", (json.dumps(CHAT) + "\n").encode() * 2), purpose="fine-tune"
    )
    assert f.id.startswith("file-") and f.purpose == "fine-tune" and f.bytes > 0
    assert sdk.files.retrieve(f.id).filename == "train.jsonl"
    assert sdk.files.content(f.id).read().count(b"\n") == 2

    jobs = [
        sdk.fine_tuning.jobs.create(
            model="tiny-llama",
            training_file=f.id,
            suffix=f"s{i}",
            seed=i,
            metadata={"i": str(i)},
            method={
                "type": "supervised",
                "supervised": {"hyperparameters": {"n_epochs": 2, "batch_size": "auto"}},
            },
            extra_body={"tunefleet": {"lora": {"r": 4}}},
        )
        for i in range(3)
    ]
    job = jobs[0]
    assert job.status == "validating_files" and job.seed == 0
    assert job.hyperparameters.n_epochs == 2 and job.hyperparameters.batch_size == 4
    assert job.method is not None and job.method.type == "supervised"
    assert sdk.fine_tuning.jobs.retrieve(job.id).id == job.id

    page1 = sdk.fine_tuning.jobs.list(limit=2)
    assert [j.id for j in page1.data] == [jobs[2].id, jobs[1].id] and page1.has_more
    page2 = sdk.fine_tuning.jobs.list(limit=2, after=page1.data[-1].id)
    assert [j.id for j in page2.data] == [jobs[0].id] and not page2.has_more
    assert [j.id for j in sdk.fine_tuning.jobs.list(metadata={"i": "1"})] == [jobs[1].id]

    events = sdk.fine_tuning.jobs.list_events(job.id, limit=10)
    assert events.data[0].message.startswith(f"Created fine-tuning job: {job.id}; auto settled")
    assert events.data[0].object == "fine_tuning.job.event"
    assert sdk.fine_tuning.jobs.checkpoints.list(job.id).data == []

    # no controller runs here, so the job waits in validating_files: pause needs queued
    with pytest.raises(openai.ConflictError, match="validating_files"):
        sdk.fine_tuning.jobs.pause(job.id)
    cancelled = sdk.fine_tuning.jobs.cancel(jobs[1].id)
    assert cancelled.status == "cancelled"
    with pytest.raises(openai.NotFoundError):
        sdk.fine_tuning.jobs.retrieve("ftjob-missing")
    with pytest.raises(openai.ConflictError, match="used by unfinished job"):
        sdk.files.delete(f.id)  # the other jobs still need it
    for other in (jobs[0], jobs[2]):
        sdk.fine_tuning.jobs.cancel(other.id)
    assert sdk.files.delete(f.id).deleted


def test_sdk_pause_and_resume(sdk: OpenAI, migrated_url: str) -> None:
    from tunefleet.platform.db import session_scope
    from tunefleet.platform.status import JobStatus, transition

    f = sdk.files.create(file=("t.jsonl", (json.dumps(CHAT) + "\n").encode()), purpose="fine-tune")
    job = sdk.fine_tuning.jobs.create(model="tiny-llama", training_file=f.id)
    with session_scope(migrated_url) as s:  # what the controller's admission does
        transition(s, job.id, JobStatus.VALIDATING_FILES, JobStatus.QUEUED, "queued")
    assert sdk.fine_tuning.jobs.pause(job.id).status == "paused"
    assert sdk.fine_tuning.jobs.resume(job.id).status == "queued"
    messages = [e.message for e in sdk.fine_tuning.jobs.list_events(job.id)]
    assert [re.sub(r"key-\w+", "KEY", m) for m in messages[:2]] == [
        "Job resumed by key KEY via the API; queued",
        "Job paused by key KEY via the API",
    ]
