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
from tunefleet.platform.artifacts import open_store
from tunefleet.platform.serving_contract import ADAPTER_HEADER, SECRET_FILE, SECRET_HEADER

pytestmark = pytest.mark.slow

TINY = "tiny-llama"
ANSWER = "red green blue"
OTHER_ANSWER = "one two three"
STEPS = 40  # of the pause/resume job
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
                        "learning_rate_multiplier": 50,
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
    assert client.post(shares, json={"tenant": "nobody"}).status_code == 404
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
            {"model": model, "prompt": ["hi"] * 5, "n": 16},
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
    unloaded = httpx.delete(
        f"{stack['serve']}/models/{TINY}/v1/adapters/{job['id']}",
        headers=serve_auth(stack),
        timeout=30,
    )
    assert unloaded.status_code == 200, unloaded.text  # held by nothing
    again = client.post("/v1/chat/completions", json=good)  # and loads again on demand
    assert again.status_code == 200
    assert again.json()["choices"][0]["message"]["content"].strip() == ANSWER


def test_pause_resume_continues_from_the_checkpoint_with_the_same_losses_and_cancel_stops(
    stack: dict[str, Any], acme_job: dict[str, Any]
) -> None:
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
                    "learning_rate_multiplier": 50,
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
    # the same job, trained straight through alongside, for resume parity (below)
    straight = client.post("/v1/fine_tuning/jobs", json=spec).json()
    _wait(client, job["id"], lambda j, ev: len(_steps(ev)) >= 3, "three steps")
    assert client.post(f"/v1/fine_tuning/jobs/{job['id']}/pause").json()["status"] == "paused"
    _, events = _wait(
        client,
        job["id"],
        lambda j, ev: any(e["message"].startswith("Paused at step") for e in ev),
        "the run to checkpoint and leave",
    )
    paused_at = int(
        next(e["message"] for e in events if e["message"].startswith("Paused at step")).split()[-1]
    )
    assert _steps(events)[-1] == paused_at
    _run_over(stack, f"{job['id']}-1")  # the run has left: no step is taken while paused
    _, events = _wait(client, job["id"], lambda j, ev: True, "events")
    assert _steps(events)[-1] == paused_at
    ckpts = client.get(f"/v1/fine_tuning/jobs/{job['id']}/checkpoints").json()["data"]
    assert ckpts[0]["step_number"] == paused_at

    # hot swap: acme's adapter keeps serving (its own answer) while this job finishes;
    # then this job's adapter answers too (its answer, not acme's), with no restart of
    # the serving application
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
            answer = resp.json()["choices"][0]["message"]["content"] if resp.is_success else ""
            served.append((resp.status_code, answer.strip()))

    background = threading.Thread(target=traffic, daemon=True)
    background.start()
    assert client.post(f"/v1/fine_tuning/jobs/{job['id']}/resume").json()["status"] == "queued"
    job, events = _wait(
        client, job["id"], lambda j, ev: j["status"] == "succeeded", "the resumed job to finish"
    )
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
    job = client.post("/v1/fine_tuning/jobs", json={**spec, "seed": 4}).json()
    _wait(client, job["id"], lambda j, ev: len(_steps(ev)) >= 1, "a first step")
    assert client.post(f"/v1/fine_tuning/jobs/{job['id']}/cancel").json()["status"] == "cancelled"
    _run_over(stack, f"{job['id']}-1")
    job, events = _wait(client, job["id"], lambda j, ev: True, "events")
    assert job["status"] == "cancelled"
    assert 1 <= len(_steps(events)) < STEPS, "stopped before its end"
    assert not stack["store"].exists(stack["store"].adapter_key(job["id"]))
