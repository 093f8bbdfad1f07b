"""The `tunefleet files|jobs|admin` commands against a real HTTP server."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tunefleet.cli.main import app
from tunefleet.platform.db import session_scope
from tunefleet.platform.settings import Settings
from tunefleet.platform.status import JobStatus, transition

CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}


@pytest.fixture
def server(live_server: Callable[..., str]) -> str:
    return live_server()


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
    assert "Job paused by key " in events and "Job cancelled by key " in events
    followed = runner.invoke(app, ["jobs", "events", job["id"], "--follow"], env=env)
    assert followed.exit_code == 0 and f"{job['id']} cancelled" in followed.output
    # an API error is printed in the API's own words, exit 1
    bad = runner.invoke(app, ["jobs", "create", "gpt-9", file_id], env=env)
    assert bad.exit_code == 1 and "unknown base model 'gpt-9'" in bad.output


def test_plan_prints_the_chart_and_refuses_bad_input_without_a_trace(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "vocab_size": 32000,
                "hidden_size": 4096,
                "intermediate_size": 11008,
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "num_key_value_heads": 32,
            }
        )
    )
    runner = CliRunner()
    gpus = {"method": "full", "resources": {"num_workers": 8, "gpus_per_worker": 1}}
    args = ["plan", str(config), "--batch-size", "64", "--device-memory-gb", "80"]
    result = runner.invoke(app, [*args, "--options", json.dumps(gpus)])
    assert result.exit_code == 0, result.output
    assert "6,738,415,616 trainable of 6,738,415,616" in result.output
    assert "advice: zero3" in result.output

    unknown = runner.invoke(app, ["plan", "no-such-model"])
    assert unknown.exit_code == 2
    assert "unknown base model 'no-such-model'" in unknown.output
    assert "Traceback" not in unknown.output
    offload = runner.invoke(app, [*args, "--options", '{"strategy": "zero3_offload"}'])
    assert offload.exit_code == 2 and "needs GPU workers" in offload.output


def test_admin_webhook_commands(
    settings: Settings, key_a: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tunefleet.platform.settings import get_settings

    monkeypatch.setenv("TUNEFLEET_DATABASE_URL", settings.resolved_database_url)
    get_settings.cache_clear()
    runner = CliRunner()
    try:
        made = runner.invoke(
            app,
            ["admin", "create-webhook", "tenant-a", "https://a.example/hook",
             "--event", "fine_tuning.job.failed", "--description", "pager"],
        )  # fmt: skip
        assert made.exit_code == 0, made.output
        endpoint = json.loads(made.output)
        assert endpoint["secret"].startswith("whsec_")
        assert endpoint["events"] == ["fine_tuning.job.failed"]
        listed = runner.invoke(app, ["admin", "list-webhooks", "tenant-a"])
        assert [json.loads(line)["id"] for line in listed.output.splitlines()] == [endpoint["id"]]
        assert "whsec_" not in listed.output
        log = runner.invoke(app, ["admin", "webhook-deliveries", endpoint["id"]])
        assert log.exit_code == 0 and log.output == ""

        bad = runner.invoke(app, ["admin", "create-webhook", "tenant-a", "ftp://x"])
        assert bad.exit_code == 2 and "'ftp://x' is not an http(s) URL" in bad.output
        assert "Traceback" not in bad.output
        nobody = runner.invoke(app, ["admin", "create-webhook", "nobody", "https://a.example"])
        assert nobody.exit_code == 2 and "no tenant 'nobody'" in nobody.output

        gone = runner.invoke(app, ["admin", "delete-webhook", endpoint["id"]])
        assert gone.exit_code == 0 and json.loads(gone.output)["deleted"] is True
        again = runner.invoke(app, ["admin", "delete-webhook", endpoint["id"]])
        assert again.exit_code == 2 and f"no webhook endpoint with id {endpoint['id']!r}" in (
            again.output
        )
    finally:
        get_settings.cache_clear()


def test_cli_imports_an_adapters_folder_and_names_a_wrong_one(
    server: str, key_a: str, tmp_path: Path, settings: Settings
) -> None:
    """`tunefleet adapters import BASE NAME FOLDER` packs and uploads the folder and imports
    it; an adapter of another model is refused in the API's words, exit code 1."""
    import torch
    from transformers import AutoModelForCausalLM

    from tinyllm import build_tiny_llama, save_random_lora

    runner = CliRunner()
    env = {"TUNEFLEET_API_URL": server, "TUNEFLEET_API_KEY": key_a}
    path = settings.resolved_model_registry / "tiny-llama"
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    folder = save_random_lora(base, tmp_path / "mine", r=4)
    out = runner.invoke(app, ["adapters", "import", "tiny-llama", "mine", str(folder)], env=env)
    assert out.exit_code == 0, out.output
    model = json.loads(out.output)
    assert model["id"].startswith("ft:tiny-llama:tenant-a:mine:adapter-")
    assert model["tunefleet"]["r"] == 4
    wider = build_tiny_llama(tmp_path / "wider", hidden=96)
    other = save_random_lora(AutoModelForCausalLM.from_pretrained(wider), tmp_path / "other")
    out = runner.invoke(app, ["adapters", "import", "tiny-llama", "other", str(other)], env=env)
    assert out.exit_code == 1
    assert "400 invalid_adapter" in out.output and "q_proj.lora_A.weight has shape" in out.output
