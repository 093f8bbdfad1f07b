"""Values that were a 500 (most on PostgreSQL only, found by tests/api/test_fuzz.py) and
are now refused with a 4xx in OpenAI's shape naming the problem, on both databases."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from conftest import TINY
from conftest import auth as H


def error(resp: Any, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body: dict[str, Any] = resp.json()["error"]
    return body


@pytest.mark.parametrize(
    "path",
    [
        "/v1/files/file-%00x",
        "/v1/fine_tuning/jobs/ftjob-%00x",
        "/v1/fine_tuning/jobs?after=%00",
        "/v1/models/ft:x%00",
    ],
)
def test_a_nul_character_is_never_a_500(
    app_client: TestClient, key_a: str, db_kind: str, path: str
) -> None:
    resp = app_client.get(path, headers=H(key_a))
    if db_kind == "postgres":  # PostgreSQL cannot even compare such a string
        assert error(resp, 400)["code"] == "invalid_value"
        assert "NUL" in resp.json()["error"]["message"]
    else:
        error(resp, 404)


@pytest.mark.parametrize("key", ["tf-\x00abcdefghijk", "tf-" + "é" * 20, "tf-short", "x" * 300])
def test_a_malformed_key_is_a_401_before_any_query(app_client: TestClient, key: str) -> None:
    resp = app_client.get("/v1/files", headers={"Authorization": f"Bearer {key}".encode()})
    assert error(resp, 401)["type"] == "authentication_error"


def test_a_long_idempotency_key_is_a_400(app_client: TestClient, key_a: str) -> None:
    resp = app_client.post(
        "/v1/fine_tuning/jobs",
        headers={**H(key_a), "Idempotency-Key": "k" * 257},
        json={"model": TINY, "training_file": "file-x"},
    )
    assert error(resp, 400)["param"] == "idempotency-key"


def test_a_long_file_name_is_a_400(app_client: TestClient, key_a: str) -> None:
    line = json.dumps({"text": "hello"}).encode()
    resp = app_client.post(
        "/v1/files",
        headers=H(key_a),
        data={"purpose": "fine-tune"},
        files={"file": ("n" * 600 + ".jsonl", line)},
    )
    err = error(resp, 400)
    assert err["param"] == "file" and "at most 512 characters" in err["message"]
    assert app_client.get("/v1/files", headers=H(key_a)).json()["data"] == []


def test_a_long_key_name_is_a_400(app_client: TestClient, settings: Any) -> None:
    from tunefleet.platform.db import session_scope
    from tunefleet.platform.tenants import create_key, create_tenant

    with session_scope(settings.resolved_database_url) as s:
        tenant = create_tenant(s, "root")
        admin = create_key(s, tenant.id, is_admin=True)[1]
        tenant_id = tenant.id
    resp = app_client.post(
        f"/v1/admin/tenants/{tenant_id}/keys", headers=H(admin), json={"name": "n" * 129}
    )
    assert error(resp, 400)["param"] == "name"


@pytest.mark.parametrize(
    "tunefleet,param,needle",
    [
        ({"lora": {"target_modules": ["lm_head"]}}, "tunefleet.lora.target_modules", "lm_head"),
        ({"method": "ia3", "ia3": {"target_modules": ["q_proj"]}}, "tunefleet.ia3", "down_proj"),
    ],
)
def test_targets_outside_a_layer_are_a_400(
    app_client: TestClient, key_a: str, tunefleet: dict[str, Any], param: str, needle: str
) -> None:
    body = {"model": TINY, "training_file": "file-x", "tunefleet": tunefleet}
    for path in ("/v1/plans", "/v1/fine_tuning/jobs"):
        err = error(app_client.post(path, headers=H(key_a), json=body), 400)
        assert err["param"] == param and needle in err["message"]


def test_a_plan_for_a_huge_device_is_a_400(app_client: TestClient, key_a: str) -> None:
    body = {"model": TINY, "training_file": "file-x", "device_memory_gb": 1.6e308}
    err = error(app_client.post("/v1/plans", headers=H(key_a), json=body), 400)
    assert err["param"] == "device_memory_gb"


@pytest.mark.parametrize(
    "line,needle",
    [
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'{"text": ' + b"1" * 5000 + b"}", "4300 digits"),
        (b'{"messages": [{"role": ["user"], "content": "q"}]}', "role is ['user']"),
    ],
)
def test_a_line_that_broke_the_validator_is_a_400(
    app_client: TestClient, key_a: str, line: bytes, needle: str
) -> None:
    resp = app_client.post(
        "/v1/files",
        headers=H(key_a),
        data={"purpose": "fine-tune"},
        files={"file": ("t.jsonl", line + b"\n")},
    )
    err = error(resp, 400)
    assert "line 1" in err["message"] and needle in err["message"]


def test_an_unknown_field_holding_an_integer_beyond_64_bits_is_a_400(
    app_client: TestClient, key_a: str, a_objects: dict[str, Any]
) -> None:
    """Unknown fields are kept with the stored request; the JSON column could not encode
    such an integer (a 500 found by the fuzzer). A 64-bit one is still kept."""
    body = {"model": TINY, "training_file": a_objects["file"]}
    resp = app_client.post(
        "/v1/fine_tuning/jobs", headers=H(key_a), json={**body, "x": {"y": [-(2**65)]}}
    )
    assert f"field 'x' holds the integer {-(2**65)}" in error(resp, 400)["message"]
    kept = app_client.post("/v1/fine_tuning/jobs", headers=H(key_a), json={**body, "x": 2**63})
    assert kept.status_code == 200, kept.text
    assert kept_fields(app_client, key_a, kept.json()["id"]) == {"x": 2**63}


def kept_fields(client: TestClient, key: str, job_id: str) -> dict[str, Any]:
    """``tunefleet.unused_request_fields`` of a job as GET returns it, checked to be the
    same in the job list."""
    job = client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=H(key))
    assert job.status_code == 200, job.text
    kept: dict[str, Any] = job.json()["tunefleet"]["unused_request_fields"]
    listed = client.get("/v1/fine_tuning/jobs", headers=H(key)).json()["data"]
    in_list = [j["tunefleet"]["unused_request_fields"] for j in listed if j["id"] == job_id]
    assert in_list == [kept]
    return kept


def test_unknown_openai_fields_are_kept_on_the_job(
    app_client: TestClient, key_a: str, a_objects: dict[str, Any]
) -> None:
    """The README: "unknown OpenAI fields kept on the job"; docs/api.md: top-level fields
    TuneFleet does not act on "are accepted and kept on the job
    (`tunefleet.unused_request_fields`)". They read back as sent, known fields not among
    them, from the answer to the create, GET of the job and the list."""
    unknown = {
        "x": {"y": [-(2**63), 2**64 - 1, 1.5, "s", True, None]},
        "future_option": "on",
    }
    body = {"model": TINY, "training_file": a_objects["file"], "suffix": "kept", **unknown}
    created = app_client.post("/v1/fine_tuning/jobs", headers=H(key_a), json=body)
    assert created.status_code == 200, created.text
    job = created.json()
    assert job["suffix"] == "kept"
    assert job["tunefleet"]["unused_request_fields"] == unknown
    assert kept_fields(app_client, key_a, job["id"]) == unknown
    # a job made without any keeps none
    assert kept_fields(app_client, key_a, a_objects["job"]) == {}


@pytest.mark.parametrize("value", ['"0"', '"-3"', "true", "false"])
def test_a_hyperparameter_as_a_string_or_a_bool_is_held_to_its_bounds(
    app_client: TestClient, key_a: str, value: str
) -> None:
    """A number sent as a string ("0") or a bool passed the bounds check and was refused
    only when the spec was built, naming the wrong field (found by the spec properties)."""
    body = '{"model": "%s", "training_file": "file-x", "hyperparameters": {"n_epochs": %s}}'
    resp = app_client.post(
        "/v1/fine_tuning/jobs",
        headers={**H(key_a), "Content-Type": "application/json"},
        content=body % (TINY, value),
    )
    assert error(resp, 400)["param"] == "hyperparameters.n_epochs"


@pytest.mark.parametrize(
    "metadata,says",
    [
        ({"k" * 65: "v"}, "is 65 characters; at most 64"),
        ({"k": "v" * 513}, "value of 'k' is 513 characters; at most 512"),
        ({"k": 5}, "value of 'k' is 5, not a string; values are strings of at most 512"),
        ({f"k{i}": "v" for i in range(17)}, "17 keys; at most 16 are allowed (remove 'k16')"),
    ],
)
def test_metadata_keys_and_values_are_bounded_as_openai_bounds_them(
    app_client: TestClient, key_a: str, metadata: dict[str, Any], says: str
) -> None:
    body = {"model": TINY, "training_file": "file-x", "metadata": metadata}
    resp = app_client.post("/v1/fine_tuning/jobs", headers=H(key_a), json=body)
    err = error(resp, 400)
    assert err["param"] == "metadata" and says in err["message"]
