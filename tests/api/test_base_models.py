"""``/v1/admin/base_models`` and ``tunefleet models add | list | remove``: an admin adds a
model from the import folder, jobs may name it at once and ``/v1/models`` lists it; its
removal is refused while a job uses it; every act is on the audit log."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from conftest import auth as H
from conftest import upload_chat
from dashboard_client import admin_key
from tunefleet.api import create_app
from tunefleet.cli.main import app as cli
from tunefleet.platform.settings import Settings

TINY = "tiny-llama"


@pytest.fixture
def own_registry(settings: Settings, tmp_path: Path, tiny_registry: Path) -> Settings:
    """Settings with a registry of this test's own (holding the tiny Llama) and an import
    folder holding a copy of it."""
    registry, imports = tmp_path / "registry", tmp_path / "imports"
    shutil.copytree(tiny_registry / TINY, registry / TINY)
    shutil.copytree(tiny_registry / TINY, imports / "llama-copy")
    return settings.model_copy(update={"model_registry": registry, "model_import_dir": imports})


@pytest.fixture
def client(own_registry: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(own_registry)) as c:
        yield c


def test_an_admin_adds_a_model_jobs_use_it_and_it_is_removed_once_unused(
    client: TestClient, own_registry: Settings, key_a: str
) -> None:
    admin = H(admin_key(own_registry))
    source = str(own_registry.model_import_dir / "llama-copy")  # type: ignore[operator]
    body = {"name": "team-llama", "source": source}
    refused = client.post("/v1/admin/base_models", headers=H(key_a), json=body)
    assert refused.status_code == 403

    outside = client.post(
        "/v1/admin/base_models", headers=admin, json={**body, "source": str(own_registry.data_dir)}
    )
    assert outside.status_code == 400
    assert "is not inside TUNEFLEET_MODEL_IMPORT_DIR" in outside.json()["error"]["message"]
    assert outside.json()["error"]["param"] == "source"

    added = client.post("/v1/admin/base_models", headers=admin, json=body)
    assert added.status_code == 200, added.text
    view = added.json()
    assert view["id"] == "team-llama" and view["architecture"] == "LlamaForCausalLM"
    assert view["problem"] is None and view["parameters"] > 0
    again = client.post("/v1/admin/base_models", headers=admin, json=body)
    assert again.status_code == 409 and "already in the registry" in again.text
    listed = client.get("/v1/admin/base_models", headers=admin).json()["data"]
    assert [m["id"] for m in listed] == ["team-llama", TINY]
    assert client.get("/v1/admin/base_models/team-llama", headers=admin).json() == view
    models = {m["id"]: m for m in client.get("/v1/models", headers=H(key_a)).json()["data"]}
    assert models["team-llama"]["owned_by"] == "tunefleet"
    assert models["team-llama"]["created"] == view["created"]

    f = upload_chat(client, key_a)
    job = client.post(
        "/v1/fine_tuning/jobs",
        headers=H(key_a),
        json={"model": "team-llama", "training_file": f["id"]},
    )
    assert job.status_code == 200, job.text
    in_use = client.delete("/v1/admin/base_models/team-llama", headers=admin)
    assert in_use.status_code == 409
    assert f"in use by job {job.json()['id']}" in in_use.json()["error"]["message"]
    client.post(f"/v1/fine_tuning/jobs/{job.json()['id']}/cancel", headers=H(key_a))
    gone = client.delete("/v1/admin/base_models/team-llama", headers=admin)
    assert gone.status_code == 200 and gone.json()["deleted"]
    assert client.get("/v1/admin/base_models/team-llama", headers=admin).status_code == 404
    assert client.delete("/v1/admin/base_models/team-llama", headers=admin).status_code == 404
    models = [m["id"] for m in client.get("/v1/models", headers=H(key_a)).json()["data"]]
    assert "team-llama" not in models
    late = client.post(
        "/v1/fine_tuning/jobs",
        headers=H(key_a),
        json={"model": "team-llama", "training_file": f["id"]},
    )
    assert late.status_code == 400 and "unknown base model 'team-llama'" in late.text

    audit = client.get("/v1/admin/audit", headers=admin).json()["data"]
    acts = [(e["action"], e["target"]["id"], e["actor"]["via"]) for e in audit[:2]]
    assert acts == [
        ("base_model.remove", "team-llama", "api"),
        ("base_model.add", "team-llama", "api"),
    ]
    assert audit[1]["after"]["source"] == source and audit[1]["actor"]["key_id"]


def test_the_cli_adds_lists_and_removes_models(own_registry: Settings, tmp_path: Path) -> None:
    runner = CliRunner()
    env = {
        "TUNEFLEET_DATA_DIR": str(own_registry.data_dir),
        "TUNEFLEET_DATABASE_URL": own_registry.resolved_database_url,
        "TUNEFLEET_MODEL_REGISTRY": str(own_registry.model_registry),
    }
    source = tmp_path / "untemplated"
    shutil.copytree(own_registry.model_registry / TINY, source)  # type: ignore[operator]
    config = json.loads((source / "tokenizer_config.json").read_text())
    template = config.pop("chat_template", None) or (source / "chat_template.jinja").read_text()
    (source / "tokenizer_config.json").write_text(json.dumps(config))
    (source / "chat_template.jinja").unlink(missing_ok=True)
    out = runner.invoke(cli, ["models", "add", "mine", str(source)], env=env)
    assert out.exit_code == 2 and "no chat template" in out.output
    (tmp_path / "template.jinja").write_text(template)
    out = runner.invoke(
        cli,
        ["models", "add", "mine", str(source), "--chat-template", str(tmp_path / "template.jinja")],
        env=env,
    )
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["architecture"] == "LlamaForCausalLM"
    out = runner.invoke(cli, ["models", "list"], env=env)
    assert out.output.split() == ["mine", TINY]
    out = runner.invoke(cli, ["models", "list", "--json"], env=env)
    assert [json.loads(line)["id"] for line in out.output.splitlines()] == ["mine", TINY]
    out = runner.invoke(cli, ["models", "remove", "mine"], env=env)
    assert out.exit_code == 0 and "removed mine" in out.output
    out = runner.invoke(cli, ["models", "remove", "mine"], env=env)
    assert out.exit_code == 2 and "no base model 'mine'" in out.output
