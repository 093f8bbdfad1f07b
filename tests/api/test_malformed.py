"""A corpus of malformed training files: each upload is a 4xx naming the line and the
problem, and nothing is left half-stored (no file row, no artifact)."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from tunefleet.platform.settings import Settings

OK = json.dumps(
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
).encode()


def chat(*messages: dict[str, object]) -> bytes:
    return json.dumps({"messages": list(messages)}).encode()


U = {"role": "user", "content": "q"}
A = {"role": "assistant", "content": "a"}

CORPUS: dict[str, tuple[bytes, int, str]] = {
    "not json": (OK + b"\n{oops\n", 400, "line 2: not valid JSON"),
    "truncated json": (OK + b'\n{"messages": [\n', 400, "line 2: not valid JSON"),
    "mixed formats": (
        OK + b'\n{"prompt": "p", "completion": "c"}\n',
        400,
        "line 2: looks like prompt_completion",
    ),
    "empty file": (b"", 400, "line 1: file has no examples"),
    "only blank lines": (b"\n\n  \n", 400, "file has no examples"),
    "missing assistant turn": (chat(U), 400, "line 1: no assistant message"),
    "unknown role": (chat(U, {"role": "wizard", "content": "x"}), 400, "role is 'wizard'"),
    "content not a string": (
        chat(U, {"role": "assistant", "content": ["a"]}),
        400,
        "content must be a string",
    ),
    "invalid utf-8": (OK + b"\n" + b'{"text": "\xc3\x28"}\n', 400, "line 2: not valid UTF-8"),
    "byte-order mark": (b"\xef\xbb\xbf" + OK, 400, "line 1: file starts with a UTF-8 BOM"),
    "array not object": (b"[1, 2, 3]\n", 400, "line 1: unrecognised example"),
    "unknown fields": (b'{"question": "q", "answer": "a"}\n', 400, "unrecognised example"),
    "bad weight": (chat(U, {**A, "weight": 0.5}), 400, "weight is 0.5; use 0 or 1"),
    "weight on user": (chat({**U, "weight": 1}, A), 400, "weight is only allowed on assistant"),
    "all assistant weights zero": (chat(U, {**A, "weight": 0}), 400, "no assistant message"),
    "messages not a list": (b'{"messages": "hello"}\n', 400, "non-empty list"),
    "completion not a string": (
        b'{"prompt": "p", "completion": 3}\n',
        400,
        "'completion' must be a string",
    ),
    "alpaca without output": (
        b'{"instruction": "i", "input": ""}\n',
        400,
        "missing field 'output'",
    ),
    "empty text": (b'{"text": ""}\n', 400, "'text' is empty"),
    "message not an object": (
        b'{"messages": ["hi", {"role": "assistant", "content": "a"}]}\n',
        400,
        "messages[0] must be an object",
    ),
    "preference pair missing its rejected answer": (
        json.dumps({"input": {"messages": [U]}, "preferred_output": [A]}).encode() + b"\n",
        400,
        "line 1: missing field 'non_preferred_output'",
    ),
    "preference pair with the same answers": (
        json.dumps(
            {"input": {"messages": [U]}, "preferred_output": [A], "non_preferred_output": [A]}
        ).encode(),
        400,
        "preferred_output and non_preferred_output are the same",
    ),
    "oversize": (
        OK + b"\n" + b'{"text": "' + b"x" * 1_100_000 + b'"}\n',
        413,
        "exceeds the limit of 1000000 bytes",
    ),
}


@pytest.mark.parametrize("name", list(CORPUS))
def test_malformed_file_is_rejected_and_nothing_kept(
    name: str, app_client: TestClient, key_a: str, settings: Settings
) -> None:
    body, status, needle = CORPUS[name]
    needle = needle.replace("UTF-8 BOM", "UTF-8 byte-order mark")
    resp = app_client.post(
        "/v1/files",
        headers={"Authorization": f"Bearer {key_a}"},
        data={"purpose": "fine-tune"},
        files={"file": ("bad.jsonl", body)},
    )
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert needle in err["message"] and err["param"] == "file"
    if status == 400:
        assert "bad.jsonl" in err["message"] and "line " in err["message"]
    listed = app_client.get("/v1/files", headers={"Authorization": f"Bearer {key_a}"})
    assert listed.json()["data"] == []
    leftovers = list((settings.resolved_artifact_root / "files").glob("*"))
    assert leftovers == []


def test_wrong_purpose_is_400(app_client: TestClient, key_a: str) -> None:
    resp = app_client.post(
        "/v1/files",
        headers={"Authorization": f"Bearer {key_a}"},
        data={"purpose": "assistants"},
        files={"file": ("a.jsonl", OK)},
    )
    assert resp.status_code == 400 and "'assistants'" in resp.json()["error"]["message"]
