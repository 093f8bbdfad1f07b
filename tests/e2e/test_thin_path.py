"""End to end on real local Ray and SQLite, through `tunefleet up` as a user runs it:
upload -> job -> Ray job running Ray Train -> adapter in the artifact store -> succeeded
with events -> Ray Serve loads the adapter -> /v1/chat/completions answers with it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import auth, create_tenants
from raycluster import free_port, stop_process
from s3 import new_bucket
from tinyllm import multiplier_for, save_random_lora
from tunefleet.platform.artifacts import open_store
from tunefleet.platform.serving_contract import ADAPTER_HEADER, SECRET_FILE, SECRET_HEADER

pytestmark = pytest.mark.slow

TINY = "tiny-llama"
ANSWER = "red green blue"
OTHER_ANSWER = "one two three"
STEPS = 120  # of the pause/resume job: long enough that the pause lands mid-run
QUESTIONS = [
    "what color is an apple",
    "name a number",
    "what is the sky",
    "name a fruit",
    "what color is grass",
    "what is one and two",
    "name a color",
    "what is a cherry",
]


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory,
    tiny_registry: Path,
    ray_cluster: Any,
    s3_endpoint: str,
) -> Iterator[dict[str, Any]]:
    """`tunefleet up` as a user runs it, on the session's Ray cluster, with its artifacts
    (uploads, checkpoints, adapters) in a bucket of a real S3 server; its bootstrap admin
    key is the one it prints at first start."""
    data = tmp_path_factory.mktemp("e2e")
    bucket = new_bucket(s3_endpoint)
    env = {
        **os.environ,
        **ray_cluster.env(),
        "TUNEFLEET_DATA_DIR": str(data),
        "TUNEFLEET_MODEL_REGISTRY": str(tiny_registry),
        "TUNEFLEET_ARTIFACT_ROOT": bucket,
        "TUNEFLEET_S3_ENDPOINT_URL": s3_endpoint,
        "TUNEFLEET_ARTIFACT_CACHE": str(data / "test-cache"),
        "TUNEFLEET_API_PORT": str(free_port()),
        "TUNEFLEET_SERVE_PORT": str(free_port()),
        "TUNEFLEET_CONTROLLER_INTERVAL_S": "0.3",
        # 64 of the tests' rank-8 all-linear adapters (64 KiB each); less than one of rank 1024
        "TUNEFLEET_SERVE_ADAPTER_MEMORY": "4Mi",
    }
    cli = [sys.executable, "-m", "tunefleet.cli.main"]
    log_path = data / "up.log"
    log = log_path.open("w")
    proc = subprocess.Popen(
        [*cli, "up", "--no-builtin-model"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{env['TUNEFLEET_API_PORT']}"
    try:
        deadline = time.monotonic() + 180
        while "Ready. Ctrl-C stops." not in log_path.read_text():
            assert proc.poll() is None, log_path.read_text()[-4000:]
            assert time.monotonic() < deadline, "tunefleet up did not become ready"
            time.sleep(0.3)
        assert httpx.get(url + "/healthz", timeout=10).status_code == 200
        printed = re.search(r"export OPENAI_API_KEY=(tf-\S+)", log_path.read_text())
        assert printed, log_path.read_text()
        keys = {"admin": printed.group(1)}  # tenant 'default', an admin key, shown once
        keys.update(create_tenants(env, ("acme", "globex")))
        yield {
            "url": url,
            "serve": f"http://127.0.0.1:{env['TUNEFLEET_SERVE_PORT']}",
            "keys": keys,
            "env": env,
            "data": data,
            "registry": tiny_registry,
            # the test's own view of the bucket (a cache of its own)
            "store": open_store(bucket, endpoint_url=s3_endpoint, cache_dir=data / "reader"),
            "log": log_path,
            "dashboard": ray_cluster.dashboard,
            "metrics": f"http://127.0.0.1:{ray_cluster.metrics_port}/metrics",
        }
    finally:
        stop_process(proc, grace_s=60)
        log.close()


def test_the_first_start_prints_an_admin_key_once(stack: dict[str, Any]) -> None:
    admin = auth(stack["keys"]["admin"])
    tenants = httpx.get(f"{stack['url']}/v1/admin/tenants", headers=admin, timeout=30)
    assert tenants.status_code == 200, tenants.text
    assert "default" in {t["name"] for t in tenants.json()["data"]}
    assert stack["log"].read_text().count("export OPENAI_API_KEY=") == 1


def _client_with_file(
    stack: dict[str, Any], tenant: str, answer: str = ANSWER
) -> tuple[httpx.Client, str]:
    """A client of ``tenant`` and the id of its upload of a dataset that answers every
    question with ``answer``."""
    client = httpx.Client(
        base_url=stack["url"],
        timeout=300,
        headers={"Authorization": f"Bearer {stack['keys'][tenant]}"},
    )
    rows = [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": answer}]}
        for q in QUESTIONS
    ]
    body = "".join(json.dumps(r) + "\n" for r in rows).encode()
    f = client.post(
        "/v1/files",
        data={"purpose": "fine-tune"},
        files={"file": ("t.jsonl", body, "application/jsonl")},
    ).json()
    return client, str(f["id"])


@pytest.fixture(scope="module")
def acme_job(stack: dict[str, Any]) -> dict[str, Any]:
    """acme's colors job, created with the API and followed to its end with
    `tunefleet jobs events --follow` (the CLI's live progress on a running job)."""
    client, file_id = _client_with_file(stack, "acme")
    job = client.post(
        "/v1/fine_tuning/jobs",
        json={
            "model": TINY,
            "training_file": file_id,
            "suffix": "colors",
            "seed": 1,
            "method": {
                "type": "supervised",
                "supervised": {
                    "hyperparameters": {
                        "n_epochs": 10,
                        "batch_size": 4,
                        "learning_rate_multiplier": multiplier_for(1e-2),
                    }
                },
            },
            "tunefleet": {
                "lora": {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["all-linear"]},
                "checkpoint_every_steps": 5,
                # 2 micro-batches of 2 per step, recomputing activations in backward
                "micro_batch_size": 2,
                "gradient_checkpointing": True,
            },
        },
    ).json()
    followed = subprocess.run(
        [sys.executable, "-m", "tunefleet.cli.main", "jobs", "events", job["id"], "--follow"],
        env={
            **stack["env"],
            "TUNEFLEET_API_URL": stack["url"],
            "TUNEFLEET_API_KEY": stack["keys"]["acme"],
        },
        capture_output=True,
        text=True,
        timeout=400,
    )
    job = client.get(f"/v1/fine_tuning/jobs/{job['id']}").json()
    return {"job": job, "followed": followed, "client": client}


def test_upload_train_serve(stack: dict[str, Any], acme_job: dict[str, Any]) -> None:
    client, job, followed = acme_job["client"], acme_job["job"], acme_job["followed"]
    assert job["status"] == "succeeded", (job["error"], stack["log"].read_text()[-4000:])
    # the CLI followed the running job to its end: its messages, the live progress bar
    # (on stderr) at the last step, and the final status line
    assert followed.returncode == 0, followed.stderr
    printed = followed.stdout.strip().splitlines()
    assert any(line.startswith("[info] Dispatched as Ray job") for line in printed)
    assert printed[-1] == f"{job['id']} succeeded {job['fine_tuned_model']}"
    assert "20/20" in followed.stderr
    assert job["fine_tuned_model"] == f"ft:{TINY}:acme:colors:{job['id']}"
    assert job["trained_tokens"] > 0

    events = client.get(f"/v1/fine_tuning/jobs/{job['id']}/events", params={"limit": 200}).json()[
        "data"
    ]
    messages = [e["message"] for e in reversed(events)]
    assert messages[0].startswith("Created fine-tuning job")
    assert any(m.startswith("Validated training file") for m in messages)
    # the workers ran where the scheduler placed them (Ray enforces it) and say so
    placed = next(e for e in events if e["message"].startswith("Dispatched as Ray job"))
    started = next(e for e in events if e["message"].startswith("Training "))
    assert started["data"]["nodes"] == placed["data"]["nodes"], (placed, started)
    assert placed["data"]["nodes"][0] in started["message"]
    assert any(
        "(2 examples x 2 micro-batch(es) per worker per step, gradient checkpointing)" in m
        for m in messages
    )
    assert messages[-1].startswith("The job has successfully completed")
    metrics = [e["data"] for e in reversed(events) if e["type"] == "metrics"]
    assert [m["step"] for m in metrics] == list(range(1, 21))
    assert metrics[-1]["train_loss"] < metrics[0]["train_loss"] / 4  # it learned
    checkpoints = client.get(f"/v1/fine_tuning/jobs/{job['id']}/checkpoints").json()["data"]
    # every 5 steps and at each epoch end (2 steps); Ray Train keeps the newest three
    saved = {int(m.split()[-1]) for m in messages if m.startswith("Checkpoint saved at step")}
    assert saved == {5, 15} | set(range(2, 21, 2))
    assert [c["step_number"] for c in checkpoints] == [20, 18, 16]
    kept = stack["store"].checkpoints_key(job["id"])
    assert all(stack["store"].exists(f"{kept}/step-{n:08d}") for n in (20, 18, 16))
    assert not stack["store"].exists(f"{kept}/step-00000014")  # in the bucket, Ray's three

    adapter = stack["store"].local_copy(stack["store"].adapter_key(job["id"]))
    assert sorted(p.name for p in adapter.iterdir()) == [
        "README.md",
        "adapter_config.json",
        "adapter_model.safetensors",
    ]

    models = [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert models == [TINY, job["fine_tuned_model"]]

    def chat(model: str, key: str = stack["keys"]["acme"]) -> httpx.Response:
        return client.post(
            "/v1/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={
                "model": model,
                "temperature": 0,
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "what is a banana"}],
            },
        )

    tuned = chat(job["fine_tuned_model"])
    assert tuned.status_code == 200, tuned.text
    out = tuned.json()
    assert out["object"] == "chat.completion" and out["model"] == job["fine_tuned_model"]
    assert out["choices"][0]["message"]["content"].strip() == ANSWER
    assert out["usage"]["completion_tokens"] > 0
    base = chat(TINY)
    assert base.status_code == 200
    assert base.json()["choices"][0]["message"]["content"].strip() != ANSWER

    # another tenant cannot use the adapter
    other = chat(job["fine_tuned_model"], key=stack["keys"]["globex"])
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"

    # the official SDK streams the same answer as server-sent events, usage last
    from openai import OpenAI

    sdk = OpenAI(base_url=stack["url"] + "/v1", api_key=stack["keys"]["acme"])
    chunks = list(
        sdk.chat.completions.create(
            model=job["fine_tuned_model"],
            messages=[{"role": "user", "content": "what is a banana"}],
            temperature=0,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip() == ANSWER
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == out["choices"][0]["finish_reason"] and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == out["usage"]["completion_tokens"]

    # per-adapter serving metrics reach Ray's Prometheus endpoint (exported every ~10 s)
    deadline = time.monotonic() + 60
    wanted = re.compile(
        r'tunefleet_adapter_requests(?:_total)?\{[^}]*adapter="' + job["id"] + r'"[^}]*\} (\d+)'
    )
    while not (m := wanted.search(httpx.get(stack["metrics"], timeout=10).text)):
        assert time.monotonic() < deadline, "no per-adapter request count in Ray's metrics"
        time.sleep(2)
    assert int(m.group(1)) >= 1
    text = httpx.get(stack["metrics"], timeout=10).text
    assert re.search(r'tunefleet_adapter_loads(?:_total)?\{[^}]*adapter="' + job["id"], text)
    assert "tunefleet_adapter_generated_tokens" in text

    # /v1/completions with n choices and a stop string
    done = sdk.completions.create(
        model=job["fine_tuned_model"], prompt="an apple is", max_tokens=6, n=2, temperature=0
    )
    assert [c.index for c in done.choices] == [0, 1]
    assert done.choices[0].text == done.choices[1].text  # greedy: the same twice
    assert done.usage is not None and done.usage.completion_tokens > 0

    _share_then_unshare(client, job["fine_tuned_model"], chat, stack)
    _merged_then_multiplexed(client, job, chat, stack)


def test_openai_sdk_evals_compare_the_base_and_the_fine_tuned_model_on_real_serving(
    sdk: Any, acme_job: dict[str, Any]
) -> None:
    """An eval through the official SDK, run by the controller on the real serving path:
    the same questions sampled from the base model and from acme's adapter (one multi-LoRA
    engine for both), graded, counted and paged; the graders' own routes agree."""
    tuned = acme_job["job"]["fine_tuned_model"]
    has_answer = {
        "type": "string_check",
        "name": "has the answer",
        "input": "{{sample.output_text}}",
        "reference": "{{item.answer}}",
        "operation": "ilike",
    }
    close = {
        "type": "text_similarity",
        "name": "close",
        "input": "{{sample.output_text}}",
        "reference": "{{item.answer}}",
        "evaluation_metric": "rouge_l",
        "pass_threshold": 0.9,
    }
    made = sdk.evals.create(
        name="colors",
        data_source_config={
            "type": "custom",
            "item_schema": {
                "type": "object",
                "properties": {"question": {"type": "string"}, "answer": {"type": "string"}},
                "required": ["question", "answer"],
            },
            "include_sample_schema": True,
        },
        testing_criteria=[has_answer, close],
    )
    content = [{"item": {"question": q, "answer": ANSWER}} for q in QUESTIONS]

    def data_source(model: str) -> dict[str, Any]:
        return {
            "type": "completions",
            "model": model,
            "input_messages": {
                "type": "template",
                "template": [{"role": "user", "content": "{{item.question}}"}],
            },
            "source": {"type": "file_content", "content": content},
            "sampling_params": {"temperature": 0, "max_completion_tokens": 8},
        }

    runs = {
        m: sdk.evals.runs.create(made.id, name=m, data_source=data_source(m)) for m in (TINY, tuned)
    }
    deadline = time.monotonic() + 240
    while any(r.status in ("queued", "in_progress") for r in runs.values()):
        assert time.monotonic() < deadline, {m: r.status for m, r in runs.items()}
        time.sleep(1)
        runs = {m: sdk.evals.runs.retrieve(r.id, eval_id=made.id) for m, r in runs.items()}
    assert {r.status for r in runs.values()} == {"completed"}, {m: r.error for m, r in runs.items()}
    n = len(QUESTIONS)
    got = runs[tuned].result_counts.model_dump()
    assert got == {"total": n, "passed": n, "failed": 0, "errored": 0}
    per = {r.testing_criteria: r.passed for r in runs[TINY].per_testing_criteria_results}
    assert per == {"has the answer": 0, "close": 0}  # the random base never says it
    usage = runs[tuned].per_model_usage[0]
    assert usage.model_name == tuned and usage.invocation_count == n
    assert usage.completion_tokens > 0

    items = list(sdk.evals.runs.output_items.list(runs[tuned].id, eval_id=made.id, limit=3))
    assert [i.datasource_item_id for i in items] == list(range(n))
    assert {i.sample.output[0].content.strip() for i in items} == {ANSWER}
    assert items[0].sample.input[0].content == QUESTIONS[0]
    assert {r.name: r.passed for r in items[0].results} == {"has the answer": True, "close": True}
    base_item = sdk.evals.runs.output_items.list(runs[TINY].id, eval_id=made.id).data[0]
    assert base_item.status == "fail" and base_item.sample.usage.completion_tokens > 0

    # graders' routes give the same score for the same sample
    sample = items[0].sample.output[0].content
    ran = sdk.fine_tuning.alpha.graders.run(
        grader=has_answer, model_sample=sample, item=items[0].datasource_item
    )
    assert ran.reward == 1.0
    assert sdk.fine_tuning.alpha.graders.validate(grader=close).grader.name == "close"
    _no_server_errors(sdk)


def test_inference_limits_hold_on_real_serving(
    stack: dict[str, Any], acme_job: dict[str, Any]
) -> None:
    """Per-tenant inference limits in front of real Ray Serve. With one request of acme's
    in flight (a 400-token stream, of which the first event has arrived: over a second of
    generation is left), its next is refused with 429 while globex is answered in the
    same moment; when the stream ends the slot is free. Over its rate, acme is told how
    long to wait, and the OpenAI SDK waits that long and is answered."""
    from openai import OpenAI

    url, admin = stack["url"], auth(stack["keys"]["admin"])
    acme_h, globex_h = auth(stack["keys"]["acme"]), auth(stack["keys"]["globex"])
    tenants = httpx.get(f"{url}/v1/admin/tenants", headers=admin).json()["data"]
    limits = f"{url}/v1/admin/tenants/" + next(t["id"] for t in tenants if t["name"] == "acme")
    question = [{"role": "user", "content": "what is a banana"}]
    short = {"model": acme_job["job"]["fine_tuned_model"], "max_tokens": 8, "messages": question}
    long = {"model": TINY, "max_tokens": 400, "messages": question, "stream": True}

    def chat(headers: dict[str, str], body: dict[str, Any] = short) -> httpx.Response:
        return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60)

    try:
        resp = httpx.patch(limits, json={"inference_concurrent_requests": 1}, headers=admin)
        assert resp.status_code == 200, resp.text
        with httpx.stream(
            "POST", f"{url}/v1/chat/completions", json=long, headers=acme_h, timeout=60
        ) as stream:
            chunks = stream.iter_raw()
            assert stream.status_code == 200 and next(chunks).startswith(b"data: ")
            refused = chat(acme_h)
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["code"] == "rate_limit_exceeded"
            assert "1 inference requests in flight" in refused.json()["error"]["message"]
            assert chat(globex_h, {**short, "model": TINY}).status_code == 200
            rest = b"".join(chunks)
        assert rest.endswith(b"data: [DONE]\n\n")
        assert chat(acme_h).status_code == 200

        changed = {"inference_concurrent_requests": None, "inference_requests_per_s": 1}
        assert httpx.patch(limits, json=changed, headers=admin).status_code == 200
        time.sleep(1.0)  # the first limit's requests have left the new bucket
        answers = [chat(acme_h), chat(acme_h)]
        assert [a.status_code for a in answers] == [200, 429]
        assert 0 < int(answers[1].headers["retry-after-ms"]) <= 1000
        assert chat(globex_h, {**short, "model": TINY}).status_code == 200
        sdk = OpenAI(base_url=url + "/v1", api_key=stack["keys"]["acme"], max_retries=2)
        out = sdk.chat.completions.create(model=short["model"], messages=question, max_tokens=8)
        assert out.choices[0].message.content
    finally:
        back = {"inference_concurrent_requests": None, "inference_requests_per_s": None}
        assert httpx.patch(limits, json=back, headers=admin).status_code == 200


def test_serve_answers_the_api_alone_and_no_run_holds_database_credentials(
    stack: dict[str, Any], acme_job: dict[str, Any]
) -> None:
    """Whoever reaches Serve's port without the API's secret is refused (naming a tenant's
    adapter by its id included), a malformed adapter id loads nothing; Ray's Jobs API
    answers only with the cluster's token, and no run carries the database's URL in what
    it shows (a run's runtime_env, entrypoint and metadata)."""
    base = f"{stack['serve']}/models/{TINY}/v1"
    chat = {"model": "x", "messages": [{"role": "user", "content": "hi"}]}
    bare = httpx.post(
        f"{base}/chat/completions",
        json=chat,
        headers={ADAPTER_HEADER: acme_job["job"]["id"]},
        timeout=30,
    )
    assert bare.status_code == 401 and bare.json()["error"]["code"] == "unauthorized", bare.text
    assert httpx.get(f"{base}/adapters", timeout=30).status_code == 401
    assert (
        httpx.get(f"{base}/adapters", headers={SECRET_HEADER: "guess"}, timeout=30).status_code
        == 403
    )
    odd = httpx.post(
        f"{base}/chat/completions",
        json=chat,
        headers={**serve_auth(stack), ADAPTER_HEADER: "../ftjob-x"},
        timeout=30,
    )
    assert odd.status_code == 400 and odd.json()["error"]["code"] == "invalid_adapter", odd.text

    assert httpx.get(f"{stack['dashboard']}/api/jobs/", timeout=30).status_code == 401
    from ray.job_submission import JobSubmissionClient

    runs = [
        j
        for j in JobSubmissionClient(stack["dashboard"]).list_jobs()
        if (j.metadata or {}).get("tunefleet_job_id")
    ]
    assert any(j.submission_id == f"{acme_job['job']['id']}-1" for j in runs)
    for j in runs:
        shown = json.dumps([j.runtime_env, j.metadata, j.entrypoint])
        assert "tunefleet.db" not in shown and "DATABASE" not in shown, shown


def _share_then_unshare(client: httpx.Client, model: str, chat: Any, stack: dict[str, Any]) -> None:
    """acme shares its adapter with globex: globex lists it (owned by acme) and calls it,
    but cannot manage its shares; unshared, it is a 404 again."""
    globex = stack["keys"]["globex"]
    shares = f"/v1/models/{model}/shares"
    resp = client.post(shares, json={"tenant": "globex"})
    assert resp.status_code == 200 and resp.json()["data"] == ["globex"], resp.text
    listed = client.get("/v1/models", headers=auth(globex)).json()["data"]
    assert [(m["id"], m["owned_by"]) for m in listed if m["id"] == model] == [(model, "acme")]
    shared = chat(model, key=globex)
    assert shared.status_code == 200, shared.text
    assert shared.json()["choices"][0]["message"]["content"].strip() == ANSWER
    assert client.post(shares, json={"tenant": "acme"}, headers=auth(globex)).status_code == 404
    # a name no tenant has is answered as globex's was (an owner cannot probe names)
    resp = client.post(shares, json={"tenant": "nobody"})
    assert resp.status_code == 200 and resp.json()["data"] == ["globex", "nobody"], resp.text
    assert client.delete(f"{shares}/nobody").status_code == 200
    assert client.delete(f"{shares}/globex").status_code == 200
    assert chat(model, key=globex).status_code == 404


def _merged_then_multiplexed(
    client: httpx.Client, job: dict[str, Any], chat: Any, stack: dict[str, Any]
) -> None:
    """One admin call serves the adapter merged into its own copy of the base (same
    greedy answer), another moves it back; the replica applies each without a restart."""
    admin = auth(stack["keys"]["admin"])
    path = f"/v1/admin/adapters/{job['fine_tuned_model']}"
    replica = f"{stack['serve']}/models/{TINY}/v1/adapters"

    def replica_state() -> dict[str, Any]:
        state: dict[str, Any] = httpx.get(replica, headers=serve_auth(stack), timeout=30).json()
        return state

    assert client.patch(path, json={"serving_mode": "merged"}).status_code == 403  # not admin
    before = chat(job["fine_tuned_model"]).json()["choices"][0]["message"]["content"]
    for mode, pinned in (("merged", True), ("multiplexed", False)):
        resp = client.patch(path, json={"serving_mode": mode, "pinned": pinned}, headers=admin)
        assert resp.status_code == 200, resp.text
        assert resp.json()["serving_mode"] == mode and resp.json()["pinned"] is pinned
        deadline = time.monotonic() + 60
        while (job["id"] in replica_state()["merged"]) != (mode == "merged"):
            assert time.monotonic() < deadline, f"replica did not switch to {mode}"
            time.sleep(0.5)
        assert (job["id"] in replica_state()["pinned"]) is pinned
        answer = chat(job["fine_tuned_model"])
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"] == before


def serve_auth(stack: dict[str, Any]) -> dict[str, str]:
    """What the API sends Serve: the secret `tunefleet up` made in its data folder."""
    return {SECRET_HEADER: (stack["data"] / SECRET_FILE).read_text().strip()}


def _wait(client: httpx.Client, job_id: str, pred: Any, what: str, timeout: float = 300) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        job = client.get(f"/v1/fine_tuning/jobs/{job_id}").json()
        events = client.get(f"/v1/fine_tuning/jobs/{job_id}/events", params={"limit": 500}).json()[
            "data"
        ][::-1]
        if pred(job, events):
            return job, events
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {job['status']}"
        time.sleep(0.5)


def _losses(events: list[dict[str, Any]]) -> list[float]:
    return [e["data"]["train_loss"] for e in events if e["type"] == "metrics"]


def _steps(events: list[dict[str, Any]]) -> list[int]:
    return [e["data"]["step"] for e in events if e["type"] == "metrics"]


def _run_over(stack: dict[str, Any], submission_id: str, timeout: float = 120) -> None:
    """Wait until Ray job ``submission_id`` has ended and none of its Ray Train workers is
    alive: past this, that run can take no step."""
    from ray.job_submission import JobStatus, JobSubmissionClient
    from ray.util.state import list_actors

    client = JobSubmissionClient(stack["dashboard"])
    deadline = time.monotonic() + timeout
    while not (info := client.get_job_info(submission_id)).status.is_terminal():
        assert time.monotonic() < deadline, f"Ray job {submission_id} still {info.status}"
        time.sleep(0.3)
    assert info.status in (JobStatus.SUCCEEDED, JobStatus.STOPPED), info
    while list_actors(
        address=stack["dashboard"],
        filters=[("job_id", "=", info.job_id), ("state", "=", "ALIVE")],
    ):
        assert time.monotonic() < deadline, f"actors of {submission_id} still alive"
        time.sleep(0.3)


def test_a_bad_request_to_serving_fails_alone(
    stack: dict[str, Any], acme_job: dict[str, Any]
) -> None:
    """Requests that cost a replica more than it gives, or that raised after their first
    rows were in the batch (a seed past 2**64, an empty prompt among others), are a 400
    naming the parameter before any row starts; good requests sent alongside answer as
    ever, and no bad request leaves the adapter held (it unloads at once afterwards)."""
    from concurrent.futures import ThreadPoolExecutor

    client, job = acme_job["client"], acme_job["job"]
    model = job["fine_tuned_model"]
    good = {
        "model": model,
        "temperature": 0,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "what is a banana"}],
    }
    long = [{"role": "user", "content": "word " * 600}]  # past the tiny model's 512
    bad = [
        ("/v1/chat/completions", {**good, "seed": 2**70}, "seed", "invalid_request"),
        ("/v1/completions", {"model": model, "prompt": ["hi", ""]}, "prompt", "empty_prompt"),
        ("/v1/chat/completions", {**good, "messages": long}, "messages", "context_length_exceeded"),
        (
            "/v1/chat/completions",
            {**good, "max_tokens": 4000},
            "messages",
            "context_length_exceeded",
        ),
        (
            "/v1/completions",
            {"model": model, "prompt": ["hi"] * 5, "n": 26},  # 130 choices: over 128
            "n",
            "too_many_choices",
        ),
        ("/v1/chat/completions", {**good, "stop": list("abcde")}, "stop", "invalid_request"),
    ]
    calls = [("/v1/chat/completions", good), *((path, body) for path, body, _, _ in bad)]
    with ThreadPoolExecutor(len(calls)) as pool:
        answers = list(pool.map(lambda call: client.post(call[0], json=call[1]), calls))
    assert answers[0].status_code == 200, answers[0].text
    assert answers[0].json()["choices"][0]["message"]["content"].strip() == ANSWER
    for (_, _, param, code), resp in zip(bad, answers[1:], strict=True):
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert (err["param"], err["code"]) == (param, code), err
    assert "maximum context length is 512 tokens" in answers[3].json()["error"]["message"]
    broken = stack["data"] / "ftjob-broken"
    broken.mkdir()
    (broken / "weights.bin").write_bytes(b"not an adapter")
    stack["store"].put_dir(stack["store"].adapter_key("ftjob-broken"), broken)
    refused = httpx.post(
        f"{stack['serve']}/models/{TINY}/v1/adapters/ftjob-broken/load",
        headers=serve_auth(stack),
        timeout=30,
    )
    assert refused.status_code == 400, refused.text  # was a 422 the SDKs do not raise as such
    assert refused.json()["error"]["code"] == "adapter_unservable"
    assert "serving_mode 'merged'" in refused.json()["error"]["message"]
    # an adapter larger than a replica's whole adapter memory: a 400 naming what it needs,
    # never an out-of-memory replica (rank 1024 on every linear layer: 8 MiB of 4)
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(stack["registry"] / TINY)
    linear = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    huge = save_random_lora(base, stack["data"] / "ftjob-huge", r=1024, targets=linear)
    stack["store"].put_dir(stack["store"].adapter_key("ftjob-huge"), huge)
    refused = httpx.post(
        f"{stack['serve']}/models/{TINY}/v1/adapters/ftjob-huge/load",
        headers=serve_auth(stack),
        timeout=60,
    )
    assert refused.status_code == 400, refused.text
    err = refused.json()["error"]
    assert err["code"] == "adapter_too_large", err
    assert (
        "rank 1024 over 14 modules needs 8.0 MiB of adapter memory, more than the 4.0 MiB"
        in (err["message"])
    )
    state = httpx.get(
        f"{stack['serve']}/models/{TINY}/v1/adapters", headers=serve_auth(stack), timeout=30
    ).json()
    assert "ftjob-huge" not in {e["id"] for e in state["data"]}
    assert state["memory"]["budget_bytes"] == 4 << 20
    assert state["memory"]["allocated_bytes"] <= 4 << 20
    unloaded = httpx.delete(
        f"{stack['serve']}/models/{TINY}/v1/adapters/{job['id']}",
        headers=serve_auth(stack),
        timeout=30,
    )
    assert unloaded.status_code == 200, unloaded.text  # held by nothing
    again = client.post("/v1/chat/completions", json=good)  # and loads again on demand
    assert again.status_code == 200
    assert again.json()["choices"][0]["message"]["content"].strip() == ANSWER


def _tracked_sdk(stack: dict[str, Any], tenant: str) -> Any:
    """The official SDK as a user makes it (its default retries on) against the running
    API for ``tenant``, with every response it got in ``.seen``, retries included: a 5xx
    would be retried silently. Close its ``.http`` after use."""
    from openai import OpenAI

    seen: list[httpx.Response] = []
    http = httpx.Client(event_hooks={"response": [seen.append]}, timeout=300)
    client = OpenAI(base_url=stack["url"] + "/v1", api_key=stack["keys"][tenant], http_client=http)
    assert client.max_retries == 2
    client.seen, client.http = seen, http  # type: ignore[attr-defined]
    return client


@pytest.fixture
def sdk(stack: dict[str, Any], acme_job: dict[str, Any]) -> Iterator[Any]:
    """acme's tracked SDK (``_tracked_sdk``), one per test: what it saw is that test's own."""
    client = _tracked_sdk(stack, "acme")
    yield client
    client.http.close()


@pytest.fixture(scope="module")
def globex_straight(stack: dict[str, Any]) -> dict[str, Any]:
    """globex's colors job of STEPS steps, trained straight through: the pause test's
    reference for resume parity (it starts alongside that test's job), and the model the
    deletion test deletes, which no other test serves."""
    client, file_id = _client_with_file(stack, "globex", answer=OTHER_ANSWER)
    spec = {
        "model": TINY,
        "training_file": file_id,
        "seed": 3,
        "method": {
            "type": "supervised",
            "supervised": {
                "hyperparameters": {
                    "n_epochs": 50,
                    "batch_size": 2,
                    "learning_rate_multiplier": multiplier_for(1e-2),
                }
            },
        },
        "tunefleet": {
            "lora": {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["all-linear"]},
            "max_steps": STEPS,
            "checkpoint_every_steps": 1000,
        },
    }
    job = client.post("/v1/fine_tuning/jobs", json=spec).json()
    return {"client": client, "file": file_id, "spec": spec, "job": job}


def _no_server_errors(sdk: Any) -> None:
    failed = [(r.request.url.path, r.status_code) for r in sdk.seen if r.status_code >= 500]
    assert not failed, failed


def test_openai_sdk_chat_parameters_are_honoured_or_refused_by_name(
    sdk: Any, acme_job: dict[str, Any], tiny_registry: Path
) -> None:
    """Every chat parameter a client sends is acted on or refused with a 400 that names
    it (issue 20): content parts, n, top_p 0, penalties, logit_bias, logprobs, structured
    outputs; tools, images, unknown arguments and schema errors are BadRequestErrors."""
    import openai
    from pydantic import BaseModel, Field
    from transformers import AutoTokenizer

    model = acme_job["job"]["fine_tuned_model"]
    ask = [{"role": "user", "content": "what is a banana"}]

    def chat(**kwargs: Any) -> Any:
        return sdk.chat.completions.create(
            **{"model": model, "messages": ask, "temperature": 0, "max_tokens": 8, **kwargs}
        )

    plain = chat()
    assert plain.choices[0].message.content.strip() == ANSWER
    parts = [{"type": "text", "text": "what is"}, {"type": "text", "text": "a banana"}]
    joined = chat(messages=[{"role": "user", "content": "what is\na banana"}])
    by_parts = chat(
        messages=[{"role": "developer", "content": "be brief"}, {"role": "user", "content": parts}]
    )
    assert by_parts.choices[0].message.content.strip() == ANSWER
    assert chat(messages=[{"role": "user", "content": parts}]).choices[0].message.content == (
        joined.choices[0].message.content
    )
    assert len(chat(n=17, temperature=1, seed=3).choices) == 17
    assert (
        chat(temperature=1, top_p=0).choices[0].message.content == plain.choices[0].message.content
    )

    # logprobs: one entry per token, the sampled (greedy) token the likeliest of the top 3
    lp = chat(logprobs=True, top_logprobs=3).choices[0]
    content = lp.logprobs.content
    assert len(content) == 8 or lp.finish_reason == "stop"
    assert "".join(t.token for t in content) == lp.message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob) and t.logprob <= 0
        assert bytes(t.bytes).decode("utf-8", errors="replace") == t.token
    streamed = chat(logprobs=True, stream=True)
    tokens = [
        t.token
        for c in streamed
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert "".join(tokens) == lp.message.content

    # logit_bias +100 on one token: every token is it; penalties are accepted and act
    tok = AutoTokenizer.from_pretrained(tiny_registry / TINY)
    x = tok("x")["input_ids"][0]
    forced = chat(logit_bias={str(x): 100}, max_tokens=4)
    assert forced.choices[0].message.content == tok.decode([x] * 4)
    penalised = chat(logit_bias={str(x): 3}, frequency_penalty=2, presence_penalty=2, max_tokens=4)
    assert penalised.choices[0].message.content != forced.choices[0].message.content

    # structured outputs on the fine-tuned adapter, the SDK's own parse()
    class Fruit(BaseModel):
        color: str = Field(max_length=12)
        sweet: bool
        rating: int = Field(ge=1, le=5)

    parsed = sdk.chat.completions.parse(
        model=model, messages=ask, response_format=Fruit, temperature=0.7, seed=1, max_tokens=80
    )
    fruit = parsed.choices[0].message.parsed
    assert isinstance(fruit, Fruit) and 1 <= fruit.rating <= 5, parsed
    shaped = chat(
        max_tokens=40,
        response_format={
            "type": "json_schema",
            "json_schema": {
                "name": "label",
                "schema": {
                    "type": "object",
                    "properties": {"label": {"enum": ["yes", "no"]}},
                    "required": ["label"],
                    "additionalProperties": False,
                },
            },
        },
    )
    assert json.loads(shaped.choices[0].message.content)["label"] in ("yes", "no")

    # json_object: an object (a bias toward "}" closes it at once: the grammar alone
    # decides what may come first)
    close = tok("}", add_special_tokens=False)["input_ids"]
    assert len(close) == 1
    obj = chat(response_format={"type": "json_object"}, logit_bias={str(close[0]): 100})
    assert json.loads(obj.choices[0].message.content) == {}, obj

    # no token limit: as much as the context leaves, not 256 (no token that ends a text
    # can be picked, so only the context stops it)
    never_end = {str(t): -100 for t in tok.all_special_ids}
    long = sdk.chat.completions.create(
        model=TINY, messages=ask, temperature=0, logit_bias=never_end
    )
    assert long.choices[0].finish_reason == "length", long
    assert long.usage.prompt_tokens + long.usage.completion_tokens == 512, long.usage

    refused = [
        (dict(max_tokens=5000), "context_length_exceeded", "messages"),
        (
            dict(
                messages=[
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
                    }
                ]
            ),
            "unsupported_content_type",
            "image_url",
        ),
        (
            dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]),
            "unsupported_parameter",
            "tools",
        ),
        (dict(extra_body={"frobnicate": 1}), "unrecognized_argument", "frobnicate"),
        (dict(temperature=5), "invalid_request", "temperature"),
        (dict(logprobs=False, top_logprobs=2), "unsupported_parameter", "top_logprobs"),
        (
            dict(
                response_format={
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {"a": {"type": "frob"}}},
                    },
                }
            ),
            "invalid_schema",
            "response_format",
        ),
        (dict(logit_bias={"999999": 5}), "invalid_value", "logit_bias"),
        (dict(stop=list("abcde")), "invalid_request", "stop"),
    ]
    sent = len(sdk.seen)
    for kwargs, code, named in refused:
        with pytest.raises(openai.BadRequestError) as bad:
            chat(**kwargs)
        assert bad.value.code == code, (kwargs, bad.value.body)
        assert named in bad.value.message, (kwargs, bad.value.message)
    assert len(sdk.seen) - sent == len(refused)  # a 400 is not retried
    _no_server_errors(sdk)


def test_openai_sdk_completions_take_token_ids_echo_logprobs_and_best_of(
    sdk: Any, acme_job: dict[str, Any], tiny_registry: Path
) -> None:
    import openai
    from transformers import AutoTokenizer

    model = acme_job["job"]["fine_tuned_model"]
    tok = AutoTokenizer.from_pretrained(tiny_registry / TINY)
    prompt = "an apple is"
    ids = tok(prompt)["input_ids"]

    def complete(**kwargs: Any) -> Any:
        return sdk.completions.create(
            **{"model": model, "temperature": 0, "max_tokens": 6, **kwargs}
        )

    text = complete(prompt=prompt).choices[0].text
    assert complete(prompt=ids).choices[0].text == text
    assert [c.text for c in complete(prompt=[ids, ids]).choices] == [text, text]
    assert complete(prompt=prompt, echo=True).choices[0].text == prompt + text
    with_logprobs = complete(prompt=prompt, logprobs=2)
    lp = with_logprobs.choices[0].logprobs
    # a token per completion token (one holding part of a character is named bytes:\xNN)
    count = with_logprobs.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == count
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(prompt + text)
    for top, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True):
        assert len(top) <= 2 and max(top.values()) == pytest.approx(v), lp  # greedy: the top
    assert lp.text_offset[0] == len(prompt)
    best = complete(prompt=prompt, temperature=1, seed=2, best_of=3, n=1)
    assert len(best.choices) == 1 and best.choices[0].logprobs is None
    one = len(tok(best.choices[0].text)["input_ids"])
    assert best.usage.completion_tokens > one  # every candidate is billed, as OpenAI does
    for kwargs, named in (
        (dict(prompt=prompt, suffix="end"), "suffix"),
        (dict(prompt=prompt, echo=True, logprobs=1), "echo"),
        (dict(prompt=[10**9]), "prompt"),
        (dict(prompt=prompt, best_of=1, n=2), "best_of"),
    ):
        with pytest.raises(openai.BadRequestError, match=named):
            complete(**kwargs)
    _no_server_errors(sdk)


def test_openai_sdk_fine_tuning_results_checkpoints_and_listings(
    sdk: Any, stack: dict[str, Any], acme_job: dict[str, Any], tiny_registry: Path
) -> None:
    """What the SDK reads of a finished job: the results CSV, checkpoints (paged, and
    callable as models by their owner only), files paged, and refusals it must not retry."""
    import openai
    from openai import OpenAI
    from transformers import AutoTokenizer

    job = sdk.fine_tuning.jobs.retrieve(acme_job["job"]["id"])
    assert job.metadata == {} and job.estimated_finish is None
    [results] = job.result_files
    assert sdk.files.retrieve(results).purpose == "fine-tune-results"
    rows = sdk.files.content(results).text.splitlines()
    assert rows[0] == "step,train_loss,train_accuracy,valid_loss,valid_mean_token_accuracy"
    assert [int(r.split(",")[0]) for r in rows[1:]] == list(range(1, 21))
    assert all(0 <= float(r.split(",")[2]) <= 1 for r in rows[1:])
    metrics = [
        e for e in sdk.fine_tuning.jobs.list_events(job.id, limit=100) if e.type == "metrics"
    ]
    assert all("train_mean_token_accuracy" in e.data for e in metrics)
    assert {e.level for e in sdk.fine_tuning.jobs.list_events(job.id, limit=100)} <= {
        "info",
        "warn",
        "error",
    }

    # auto-pagination visits each checkpoint once and ends
    checkpoints = list(sdk.fine_tuning.jobs.checkpoints.list(job.id, limit=1))
    assert [c.step_number for c in checkpoints] == [20, 18, 16]
    name = checkpoints[-1].fine_tuned_model_checkpoint
    assert name == f"{job.fine_tuned_model}:ckpt-step-16"
    answer = sdk.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": "what is a banana"}],
        temperature=0,
        max_tokens=8,
    )
    assert answer.model == name and answer.choices[0].message.content.strip() == ANSWER
    # sampled (temperature 1): no token that ends a text, or an end drawn first gives
    # fewer than 4 (it did once in CI)
    tok = AutoTokenizer.from_pretrained(tiny_registry / TINY)
    never_end = {str(t): -100 for t in tok.all_special_ids}
    completed = sdk.completions.create(
        model=name, prompt="an apple is", max_tokens=4, logit_bias=never_end
    )
    assert completed.model == name and completed.usage.completion_tokens == 4
    globex = OpenAI(base_url=stack["url"] + "/v1", api_key=stack["keys"]["globex"])
    with pytest.raises(openai.NotFoundError):
        globex.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}])
    gone = name.replace("ckpt-step-16", "ckpt-step-14")  # saved, then dropped by Ray Train
    with pytest.raises(openai.NotFoundError, match="no longer kept"):
        sdk.chat.completions.create(model=gone, messages=[{"role": "user", "content": "hi"}])

    files = list(sdk.files.list(limit=1))
    assert len(files) == len({f.id for f in files}) >= 2
    assert [f.created_at for f in files] == sorted((f.created_at for f in files), reverse=True)
    oldest_first = list(sdk.files.list(limit=1, order="asc"))
    assert [f.id for f in oldest_first] == [f.id for f in reversed(files)]
    after = sdk.files.list(limit=1, order="asc", after=oldest_first[0].id).data
    assert [f.id for f in after] == [oldest_first[1].id]
    base = sdk.models.retrieve(TINY)
    assert base.created > 0

    # refusals a retry cannot help are sent once; a schema error is a 400, not a 422
    sent = len(sdk.seen)
    with pytest.raises(openai.ConflictError):
        sdk.fine_tuning.jobs.pause(job.id)
    assert len(sdk.seen) - sent == 1
    with pytest.raises(openai.RateLimitError, match="max_gpus") as quota:
        sdk.fine_tuning.jobs.create(
            model=TINY,
            training_file=job.training_file,
            extra_body={"tunefleet": {"resources": {"num_workers": 2, "gpus_per_worker": 8}}},
        )
    assert quota.value.response.headers["x-should-retry"] == "false"
    assert len(sdk.seen) - sent == 2
    with pytest.raises(openai.BadRequestError, match="n_epochs"):
        sdk.fine_tuning.jobs.create(
            model=TINY,
            training_file=files[-1].id,
            method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": "lots"}}},
        )
    for metadata, named in (({"k" * 65: "v"}, "64"), ({"k": "v" * 513}, "512")):
        with pytest.raises(openai.BadRequestError, match=named) as bad:
            sdk.fine_tuning.jobs.create(
                model=TINY, training_file=job.training_file, metadata=metadata
            )
        assert bad.value.param == "metadata", bad.value.body
    _no_server_errors(sdk)


def test_pause_resume_in_the_dashboard_continues_from_the_checkpoint_with_the_same_losses(
    stack: dict[str, Any], acme_job: dict[str, Any], globex_straight: dict[str, Any]
) -> None:
    """globex follows its job in a real browser on the running stack (issue 21): the loss
    curve grows with no reload, the pause button checkpoints the run and it leaves (no step
    while paused), the resume button continues it from that checkpoint, every step drawn
    once, with exactly the losses of the same job trained straight through alongside.
    Meanwhile acme's adapter keeps serving and the new adapter joins with no restart of the
    serving application (hot swap); then a cancelled job stops with no adapter. (The SDK's
    pause and resume: the DPO test below.)"""
    from browser import chromium, points, sign_in, watch_csp

    client, spec = globex_straight["client"], globex_straight["spec"]
    straight = globex_straight["job"]  # the same job, trained straight through alongside
    job = client.post("/v1/fine_tuning/jobs", json=spec).json()
    url, page_of = stack["url"], f"{stack['url']}/ui/jobs/{job['id']}"

    def until(check: Any, what: str, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            assert time.monotonic() < deadline, f"the page never showed {what}"
            page.wait_for_timeout(500)

    # hot swap: acme's adapter keeps serving (its own answer) while this job finishes;
    # then this job's adapter answers too (its answer, not acme's)
    acme = httpx.Client(
        base_url=stack["url"],
        timeout=300,
        headers={"Authorization": f"Bearer {stack['keys']['acme']}"},
    )
    acme_model = acme_job["job"]["fine_tuned_model"]
    served: list[tuple[int, str]] = []
    done = threading.Event()

    def traffic() -> None:
        while not done.is_set():
            body = {"model": acme_model, "max_tokens": 8, "temperature": 0}
            body["messages"] = [{"role": "user", "content": "name a color"}]
            resp = acme.post("/v1/chat/completions", json=body)
            if resp.status_code == 429:  # over acme's rate: wait as told, as the SDK does
                time.sleep(int(resp.headers["retry-after-ms"]) / 1000)
                continue
            answer = resp.json()["choices"][0]["message"]["content"] if resp.is_success else ""
            served.append((resp.status_code, answer.strip()))

    with chromium() as browser:
        page = browser.new_context().new_page()
        violations = watch_csp(page)
        sign_in(page, url, stack["keys"]["globex"])
        page.goto(page_of)
        until(lambda: page.locator("#loss polyline").count() and points(page) >= 2, "a step")
        page.evaluate("window.tunefleetMarker = 'same document'")
        drawn = points(page)
        until(lambda: points(page) > drawn, "the curve grow")
        assert page.evaluate("window.tunefleetMarker") == "same document"

        page.click("button.action-pause")
        page.wait_for_url(f"{page_of}?done=pause")
        assert client.get(f"/v1/fine_tuning/jobs/{job['id']}").json()["status"] == "paused"
        _, events = _wait(
            client,
            job["id"],
            lambda j, ev: any(e["message"].startswith("Paused at step") for e in ev),
            "the run to checkpoint and leave",
        )
        paused_at = int(
            next(e["message"] for e in events if e["message"].startswith("Paused at step")).split()[
                -1
            ]
        )
        assert _steps(events)[-1] == paused_at < STEPS
        _run_over(stack, f"{job['id']}-1")  # the run has left: no step is taken while paused
        _, events = _wait(client, job["id"], lambda j, ev: True, "events")
        assert _steps(events)[-1] == paused_at
        ckpts = client.get(f"/v1/fine_tuning/jobs/{job['id']}/checkpoints").json()["data"]
        assert ckpts[0]["step_number"] == paused_at
        page.goto(page_of)
        assert "paused" in page.locator("#job-live .status").inner_text()
        assert points(page) == paused_at

        background = threading.Thread(target=traffic, daemon=True)
        background.start()
        page.click("button.action-resume")
        page.wait_for_url(f"{page_of}?done=resume")
        until(lambda: "succeeded" in page.locator("#job-live .status").inner_text(), "success")
        page.goto(page_of)
        assert points(page) == STEPS  # each step once: resumed where it paused
        assert page.locator("button.action-resume").count() == 0
        assert violations == []

    job, events = _wait(client, job["id"], lambda j, ev: j["status"] == "succeeded", "success")
    new_answer = client.post(
        "/v1/chat/completions",
        json={
            "model": job["fine_tuned_model"],
            "max_tokens": 8,
            "temperature": 0,
            "messages": [{"role": "user", "content": "what is a banana"}],
        },
    )
    done.set()
    background.join(120)
    assert new_answer.status_code == 200, new_answer.text
    assert new_answer.json()["choices"][0]["message"]["content"].strip() == OTHER_ANSWER
    # in-flight requests all completed, each with acme's adapter's answer
    assert served and set(served) == {(200, ANSWER)}, served
    assert stack["log"].read_text().count("Application 'tunefleet-tiny-llama' is ready") == 1
    steps = _steps(events)
    assert steps == list(range(1, STEPS + 1)), "resumed at the checkpoint step, none done twice"
    assert any(f"resumed at step {paused_at}" in e["message"] for e in events)
    assert [e["data"]["attempt"] for e in events if e["message"].startswith("Dispatched")] == [1, 2]

    # resume parity: the same job trained straight through has exactly the same losses
    _, straight_events = _wait(
        client,
        straight["id"],
        lambda j, ev: j["status"] == "succeeded",
        "the straight job to finish",
    )
    assert _losses(straight_events) == _losses(events)

    # cancel a running job: the Ray job stops, no adapter is made
    from openai import OpenAI

    globex = OpenAI(base_url=stack["url"] + "/v1", api_key=stack["keys"]["globex"])
    job = client.post("/v1/fine_tuning/jobs", json={**spec, "seed": 4}).json()
    _wait(client, job["id"], lambda j, ev: len(_steps(ev)) >= 1, "a first step")
    cancelled = globex.fine_tuning.jobs.cancel(job["id"])
    assert cancelled.status == "cancelled" and cancelled.estimated_finish is None
    _run_over(stack, f"{job['id']}-1")
    job, events = _wait(client, job["id"], lambda j, ev: True, "events")
    assert job["status"] == "cancelled" and job["estimated_finish"] is None
    assert 1 <= len(_steps(events)) < STEPS, "stopped before its end"
    assert not stack["store"].exists(stack["store"].adapter_key(job["id"]))


def test_dpo_continues_a_supervised_adapter_through_the_api_pauses_resumes_and_serves(
    stack: dict[str, Any], acme_job: dict[str, Any]
) -> None:
    """SFT then DPO, through the API on real Ray: acme uploads preference pairs (validated
    with token statistics of both answers), and creates a DPO job that continues its
    supervised colors job's adapter, preferring another answer over the one that job
    taught, and the same job again, trained straight through alongside. The first is
    paused mid-run and resumed: it continues from its checkpoint with the reference scores
    its first run took, and ends with exactly the straight job's losses and DPO metrics
    (paused and resumed through the official SDK: no estimated finish while paused).
    Its adapter is served like any other, and no longer gives the answer it was taught to
    disprefer."""
    client = acme_job["client"]
    sft = acme_job["job"]
    pairs = [
        {
            "input": {"messages": [{"role": "user", "content": q}]},
            "preferred_output": [{"role": "assistant", "content": OTHER_ANSWER}],
            "non_preferred_output": [{"role": "assistant", "content": ANSWER}],
        }
        for q in QUESTIONS
    ]
    body = "".join(json.dumps(p) + "\n" for p in pairs).encode()
    f = client.post(
        "/v1/files",
        data={"purpose": "fine-tune"},
        files={"file": ("pairs.jsonl", body, "application/jsonl")},
    ).json()
    assert f["tunefleet"]["format"] == "preference", f
    spec = {
        "model": TINY,
        "training_file": f["id"],
        "seed": 5,
        "method": {
            "type": "dpo",
            "dpo": {
                "hyperparameters": {
                    "n_epochs": 5,
                    "batch_size": 2,
                    "beta": 0.5,
                    "learning_rate_multiplier": multiplier_for(1e-2, "lora", "dpo"),
                }
            },
        },
        "tunefleet": {
            # the supervised job's adapter shape
            "lora": {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["all-linear"]},
            "init_from_job": sft["fine_tuned_model"],
            "checkpoint_every_steps": 1000,
        },
    }
    job = client.post("/v1/fine_tuning/jobs", json=spec).json()
    assert job["method"]["type"] == "dpo" and job["tunefleet"]["init_from_job"] == sft["id"], job
    straight = client.post("/v1/fine_tuning/jobs", json=spec).json()
    from openai import OpenAI

    sdk = OpenAI(base_url=stack["url"] + "/v1", api_key=stack["keys"]["acme"])
    _wait(client, job["id"], lambda j, ev: len(_steps(ev)) >= 3, "three steps")
    assert sdk.fine_tuning.jobs.retrieve(job["id"]).estimated_finish is not None
    paused = sdk.fine_tuning.jobs.pause(job["id"])
    assert paused.status == "paused" and paused.estimated_finish is None
    _, events = _wait(
        client,
        job["id"],
        lambda j, ev: any(e["message"].startswith("Paused at step") for e in ev),
        "the run to checkpoint and leave",
    )
    # the run's last reports came after the pause: still no estimate
    assert sdk.fine_tuning.jobs.retrieve(job["id"]).estimated_finish is None
    _run_over(stack, f"{job['id']}-1")
    assert sdk.fine_tuning.jobs.resume(job["id"]).status == "queued"
    job, events = _wait(
        client, job["id"], lambda j, ev: j["status"] == "succeeded", "the resumed DPO job"
    )
    _, straight_events = _wait(
        client, straight["id"], lambda j, ev: j["status"] == "succeeded", "the straight DPO job"
    )
    validated = next(e for e in events if e["message"].startswith("Validated training file"))
    stats = validated["data"]["training_file"]
    assert stats["examples"] == len(QUESTIONS) and stats["trained_tokens"] > 0, stats
    starts = [e["message"] for e in events if e["message"].startswith("Training ")]
    assert len(starts) == 2 and "resumed at step" in starts[1]
    assert all(f"from job {sft['id']}'s weights" in m for m in starts)
    precomputed = [e for e in events if "precomputed in" in e["message"]]
    assert len(precomputed) == 1, "the resumed run kept its first run's reference scores"
    steps = _steps(events)
    assert steps == list(range(1, 21)), steps
    keys = ("train_loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies")

    def metrics(evs: list[dict[str, Any]]) -> dict[int, tuple[float, ...]]:
        return {
            e["data"]["step"]: tuple(e["data"][k] for k in keys)
            for e in evs
            if e["type"] == "metrics"
        }

    assert metrics(events) == metrics(straight_events)
    last = metrics(events)[20]
    assert last[0] < metrics(events)[1][0] and last[1] > last[2]
    answer = client.post(
        "/v1/chat/completions",
        json={
            "model": job["fine_tuned_model"],
            "max_tokens": 8,
            "temperature": 0,
            "messages": [{"role": "user", "content": QUESTIONS[0]}],
        },
    )
    assert answer.status_code == 200, answer.text
    # the supervised adapter's answer is the non-preferred one: no longer what it says
    # (what the preferred behaviour looks like on a real model: test_dpo_efficacy.py)
    assert answer.json()["choices"][0]["message"]["content"].strip() != ANSWER


def test_the_dashboard_serves_an_adapter_merged_and_shows_its_traffic(
    stack: dict[str, Any], acme_job: dict[str, Any]
) -> None:
    """The adapters page on the running stack (issue 21): an admin in a real browser sees
    acme's model with the requests Serve's replicas counted (Ray's metrics), switches it to
    merged with the button, the replica serves it merged with the same greedy answer, and
    switches it back."""
    from browser import chromium, sign_in, watch_csp

    job = acme_job["job"]
    client = httpx.Client(base_url=stack["url"], headers=auth(stack["keys"]["acme"]), timeout=60)
    replica = f"{stack['serve']}/models/{TINY}/v1/adapters"

    def merged() -> bool:
        state = httpx.get(replica, headers=serve_auth(stack), timeout=30).json()
        return job["id"] in state["merged"]

    def chat() -> str:
        resp = client.post(
            "/v1/chat/completions",
            json={"model": job["fine_tuned_model"], "temperature": 0, "max_tokens": 8,
                  "messages": [{"role": "user", "content": "what is a banana"}]},
        )  # fmt: skip
        assert resp.status_code == 200, resp.text
        return str(resp.json()["choices"][0]["message"]["content"])

    before = chat()
    card = f"#adapter-{job['id']}"
    with chromium() as browser:
        page = browser.new_context().new_page()
        violations = watch_csp(page)
        sign_in(page, stack["url"], stack["keys"]["admin"])
        # the replicas' counts reach Ray's metrics agent every few seconds
        deadline = time.monotonic() + 90
        while True:
            page.goto(f"{stack['url']}/ui/adapters")
            facts = page.locator(card).inner_text()
            requests = re.search(r"Requests\s+([\d,]+)", facts)
            if requests and int(requests.group(1).replace(",", "")) >= 1:
                break
            assert time.monotonic() < deadline, f"no requests shown for the adapter: {facts}"
            page.wait_for_timeout(2000)
        assert "multiplexed on the shared base" in facts
        assert re.search(r"Loaded on\s+\S", facts) and "no replica now" not in facts, facts
        for button, wanted in (("merged", True), ("multiplexed", False)):
            page.click(f"{card} button.action-{button}")
            page.wait_for_url(re.compile(r".*/ui/adapters\?done=" + button))
            served = "merged into its own copy" if wanted else "multiplexed on the shared base"
            assert served in page.locator(card).inner_text()
            deadline = time.monotonic() + 60
            while merged() != wanted:
                assert time.monotonic() < deadline, f"the replica did not switch to {button}"
                time.sleep(0.5)
            assert chat() == before
        assert violations == []


def test_the_playground_streams_the_base_and_an_adapter_side_by_side(
    stack: dict[str, Any], acme_job: dict[str, Any]
) -> None:
    """The playground on the running stack (issue 21): acme asks its base model and its
    fine-tuned model one prompt in a real browser; both answers stream in through the API
    from the real Serve replica, each with its tokens/s, and the fine-tuned column says
    what the adapter says through the SDK."""
    from browser import chromium, sign_in, watch_csp

    model = acme_job["job"]["fine_tuned_model"]
    with chromium() as browser:
        page = browser.new_context().new_page()
        violations = watch_csp(page)
        sign_in(page, stack["url"], stack["keys"]["acme"])
        page.goto(f"{stack['url']}/ui/playground")
        page.select_option("#pg-model-1", TINY)
        page.select_option("#pg-model-2", model)
        page.select_option("#pg-model-3", "")
        page.fill("#pg-prompt", "what is a banana")
        page.fill("#pg-max", "8")
        page.click("#playground button[type=submit]")
        deadline = time.monotonic() + 120  # (wait_for_function evaluates: the CSP refuses)
        while page.locator(".pg-column[data-done]").count() < 3:
            assert time.monotonic() < deadline, "the answers never finished streaming"
            page.wait_for_timeout(250)
        columns = page.locator(".pg-column")
        for i in (0, 1):
            stats = columns.nth(i).locator(".pg-stats").inner_text()
            assert re.fullmatch(
                r"\d+ tokens · [\d.]+ tokens/s · first token after [\d.]+ s", stats
            ), stats
            assert int(columns.nth(i).get_attribute("data-tokens") or 0) >= 1
        assert columns.nth(1).locator(".pg-output").inner_text().strip() == ANSWER
        assert columns.nth(2).locator(".pg-output").inner_text() == ""
        assert violations == []


def test_openai_sdk_deletes_a_fine_tuned_model_and_it_stops_answering(
    stack: dict[str, Any], globex_straight: dict[str, Any]
) -> None:
    """globex deletes the model of its straight job (which no other test serves)."""
    import openai

    job, _ = _wait(
        globex_straight["client"],
        globex_straight["job"]["id"],
        lambda j, ev: j["status"] == "succeeded",
        "the straight job to finish",
    )
    sdk = _tracked_sdk(stack, "globex")
    model = job["fine_tuned_model"]
    assert sdk.chat.completions.create(  # served until deleted
        model=model, max_tokens=8, messages=[{"role": "user", "content": "hi"}]
    ).choices
    deleted = sdk.models.delete(model)
    assert deleted.deleted and deleted.id == model
    assert model not in [m.id for m in sdk.models.list()]
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.NotFoundError):
        sdk.models.delete(model)
    with pytest.raises(openai.PermissionDeniedError, match="base model"):
        sdk.models.delete(TINY)
    _no_server_errors(sdk)
    sdk.http.close()


def test_an_imported_adapter_answers_through_real_serving(
    stack: dict[str, Any], tiny_registry: Path, tmp_path: Path
) -> None:
    """globex uploads a LoRA adapter peft saved (a .tar) and imports it; the controller
    serves its base (an imported adapter's base no run prepared), and the model answers
    chat completions through Ray Serve as peft computes with that adapter: wherever no
    near tie leaves the float32 argmax open, the very tokens of peft's float64 decode."""
    import io
    import tarfile

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from float64 import assert_greedy, double
    from tinyllm import save_random_lora

    path = tiny_registry / TINY
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    folder = save_random_lora(base, tmp_path / "brought", r=8, alpha=16, seed=11,
                              targets=("q_proj", "v_proj", "o_proj"))  # fmt: skip
    packed = io.BytesIO()
    with tarfile.open(fileobj=packed, mode="w") as tar:
        tar.add(folder, arcname="brought")
    key = stack["keys"]["globex"]
    client = httpx.Client(
        base_url=stack["url"], timeout=300, headers={"Authorization": f"Bearer {key}"}
    )
    up = client.post("/v1/files", data={"purpose": "adapter"},
                     files={"file": ("brought.tar", packed.getvalue())})  # fmt: skip
    assert up.status_code == 200, up.text
    made = client.post("/v1/models", json={"base_model": TINY, "name": "brought",
                                            "file_id": up.json()["id"]})  # fmt: skip
    assert made.status_code == 200, made.text
    model = made.json()["id"]

    from peft import PeftModel

    reference = double(PeftModel.from_pretrained(base, str(folder)).eval())
    tok = AutoTokenizer.from_pretrained(path)
    sdk = _tracked_sdk(stack, "globex")
    messages = [{"role": "user", "content": "what color is an apple"}]
    deadline = time.monotonic() + 240
    while True:  # until its base is served (the controller deploys it within a pass or so)
        try:
            answer = sdk.chat.completions.create(
                model=model, messages=messages, max_tokens=8, temperature=0
            )
            break
        except Exception:
            assert time.monotonic() < deadline, "the imported adapter's model never answered"
            time.sleep(2)
    prompt = list(  # as serving builds it
        tok.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
    )
    eos = {tok.eos_token_id}
    # peft's own float64 greedy decode; where every choice was decided, the served text is it
    tokens: list[int] = []
    with torch.inference_mode():
        for _ in range(8):
            logits = reference(input_ids=torch.tensor([prompt + tokens])).logits[0, -1]
            nxt = int(logits.argmax())
            if nxt in eos:
                break
            tokens.append(nxt)
    decided = assert_greedy(reference, prompt, tokens, 8, eos)
    if decided == len(tokens) + (len(tokens) < 8):
        assert answer.choices[0].message.content == tok.decode(tokens), (answer, tokens)
    assert answer.choices[0].message.content
    sdk.http.close()
