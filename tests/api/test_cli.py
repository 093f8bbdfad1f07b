"""The `tunefleet files|jobs|admin` commands against a real HTTP server."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from typer.testing import CliRunner

from tunefleet.api import create_app
from tunefleet.cli.main import app
from tunefleet.platform.db import session_scope
from tunefleet.platform.settings import Settings
from tunefleet.platform.status import JobStatus, transition

CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}


@pytest.fixture
def server(settings: Settings) -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(create_app(settings), port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            httpx.get(url + "/healthz")
            break
        except httpx.TransportError:
            time.sleep(0.05)
    yield url
    srv.should_exit = True
    thread.join(10)


def test_cli_drives_files_and_jobs(
    server: str, key_a: str, tmp_path: Path, settings: Settings
) -> None:
    runner = CliRunner()
    env = {"TUNEFLEET_API_URL": server, "TUNEFLEET_API_KEY": key_a}
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps(CHAT) + "\n")
    out = runner.invoke(app, ["files", "upload", str(data)], env=env)
    assert out.exit_code == 0, out.output
    file_id = json.loads(out.output)["id"]
    out = runner.invoke(
        app,
        [
            "jobs",
            "create",
            "tiny-llama",
            file_id,
            "--suffix",
            "cli",
            "--epochs",
            "2",
            "--options",
            '{"lora": {"r": 4}}',
        ],
        env=env,
    )
    assert out.exit_code == 0, out.output
    job = json.loads(out.output)
    assert job["hyperparameters"]["n_epochs"] == 2 and job["tunefleet"]["lora"]["r"] == 4
    listed = runner.invoke(app, ["jobs", "list"], env=env).output
    assert job["id"] in listed and "validating_files" in listed
    assert (
        json.loads(runner.invoke(app, ["jobs", "get", job["id"]], env=env).output)["id"]
        == (job["id"])
    )
    with session_scope(settings.resolved_database_url) as s:
        transition(s, job["id"], JobStatus.VALIDATING_FILES, JobStatus.QUEUED, "queued")
    assert "paused" in runner.invoke(app, ["jobs", "pause", job["id"]], env=env).output
    assert "queued" in runner.invoke(app, ["jobs", "resume", job["id"]], env=env).output
    assert "cancelled" in runner.invoke(app, ["jobs", "cancel", job["id"]], env=env).output
    events = runner.invoke(app, ["jobs", "events", job["id"]], env=env).output
    assert "Job paused by request" in events and "Job cancelled by request" in events
    followed = runner.invoke(app, ["jobs", "events", job["id"], "--follow"], env=env)
    assert followed.exit_code == 0 and f"{job['id']} cancelled" in followed.output
    # an API error is printed in the API's own words, exit 1
    bad = runner.invoke(app, ["jobs", "create", "gpt-9", file_id], env=env)
    assert bad.exit_code == 1 and "unknown base model 'gpt-9'" in bad.output
