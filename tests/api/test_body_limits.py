"""Request bodies are authenticated before they are read and bounded while they are read
(``tunefleet.api._body_limits``): a chunked upload or JSON body over its limit is stopped
with 413 once the limit is passed, not after it was read whole; a request without a valid
key is a 401 before a byte of its body is pulled. Bodies here are generators that count
what the app pulled from them, sent without ``content-length`` (chunked) unless a test
declares one.

What the multipart parser spools is counted too: Starlette's spool file is unlinked as it
is created, so an empty spool folder proves nothing; the bytes written to it do."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from tempfile import SpooledTemporaryFile
from typing import Any

import httpx
import pytest
from starlette import formparsers

from conftest import CHAT, TINY
from conftest import auth as H
from tunefleet.api import create_app
from tunefleet.api._body_limits import MULTIPART_ALLOWANCE
from tunefleet.platform.settings import Settings

CHUNK = 64 * 1024
BOUNDARY = "tunefleet-test-boundary"


class Body:
    """A request body of ``head``, then ``size`` bytes of filler in CHUNK pieces, then
    ``tail``; ``pulled`` counts the bytes the app has taken so far."""

    def __init__(self, head: bytes, size: int, tail: bytes = b"", filler: bytes = b"x"):
        self.head, self.size, self.tail, self.filler = head, size, tail, filler
        self.pulled = 0

    @property
    def total(self) -> int:
        return len(self.head) + self.size + len(self.tail)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        self.pulled += len(self.head)
        yield self.head
        sent = 0
        whole = self.filler * max(1, CHUNK // len(self.filler))  # whole lines of filler
        while sent < self.size:
            piece = whole[: self.size - sent]
            sent += len(piece)
            self.pulled += len(piece)
            yield piece
        self.pulled += len(self.tail)
        yield self.tail


def upload_body(size: int) -> Body:
    """multipart/form-data: purpose=fine-tune and a file of valid JSONL lines."""
    head = (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nfine-tune\r\n'
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"'
        "\r\nContent-Type: application/jsonl\r\n\r\n"
    ).encode()
    line = (json.dumps(CHAT) + "\n").encode()
    return Body(head, size, f"\r\n--{BOUNDARY}--\r\n".encode(), filler=line)


UPLOAD_TYPE = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}
JSON_TYPE = {"Content-Type": "application/json"}


def json_body(field: str, size: int, **fields: Any) -> Body:
    """``{...fields, field: "xxxx..."}`` with a string of ``size`` bytes."""
    head = json.dumps(fields)[:-1].encode() + f', "{field}": "'.encode()
    return Body(head, size, b'"}')


def send(settings: Settings, path: str, body: Body, headers: dict[str, str]) -> httpx.Response:
    app = create_app(settings)

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as c:
            return await c.post(path, content=body, headers=headers)

    return asyncio.run(go())


class CountedSpool(SpooledTemporaryFile[bytes]):
    """Starlette's spool file for an uploaded part, counting the bytes written to it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.written = 0

    def write(self, s: Any) -> int:
        self.written += len(s)
        return super().write(s)


@pytest.fixture
def spools(monkeypatch: pytest.MonkeyPatch) -> list[CountedSpool]:
    """Every spool file the multipart parser creates during the test, in order."""
    made: list[CountedSpool] = []

    def spool(*args: Any, **kwargs: Any) -> CountedSpool:
        made.append(CountedSpool(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(formparsers, "SpooledTemporaryFile", spool)
    return made


def stored_files(settings: Settings) -> list[Path]:
    return [p for p in settings.resolved_artifact_root.rglob("*") if p.is_file()]


def test_chunked_upload_over_the_limit_is_stopped_while_reading(
    settings: Settings, key_a: str, spools: list[CountedSpool]
) -> None:
    body = upload_body(10 * settings.max_upload_bytes)
    resp = send(settings, "/v1/files", body, {**H(key_a), **UPLOAD_TYPE})
    assert resp.status_code == 413, resp.text
    error = resp.json()["error"]
    assert error["code"] == "file_too_large" and error["param"] == "file"
    assert str(settings.max_upload_bytes) in error["message"]
    assert "TUNEFLEET_MAX_UPLOAD_BYTES" in error["message"]
    # stopped at the limit, not after the 10 MB were read and spooled to disk (the spool
    # rolls to disk past 1 MiB); the one spool file begun is closed, freeing its blocks
    assert body.pulled <= settings.max_upload_bytes + MULTIPART_ALLOWANCE + CHUNK
    assert len(spools) == 1 and spools[0].closed
    assert 0 < spools[0].written <= settings.max_upload_bytes + MULTIPART_ALLOWANCE
    assert stored_files(settings) == []


def test_chunked_upload_within_the_limit_is_stored(
    settings: Settings, key_a: str, spools: list[CountedSpool]
) -> None:
    line = len(json.dumps(CHAT)) + 1
    body = upload_body(line * (settings.max_upload_bytes // line // 2))
    resp = send(settings, "/v1/files", body, {**H(key_a), **UPLOAD_TYPE})
    assert resp.status_code == 200, resp.text
    assert resp.json()["tunefleet"]["stats"]["examples"] == settings.max_upload_bytes // line // 2
    assert body.pulled == body.total
    # the spool counter sees Starlette's spooling, so its counts elsewhere mean something
    assert [s.written for s in spools] == [body.size] and spools[0].closed


@pytest.mark.parametrize("key", [None, "tf-notarealkey123"])
def test_unauthenticated_upload_is_refused_before_its_body_is_read(
    settings: Settings, key: str | None, spools: list[CountedSpool]
) -> None:
    body = upload_body(10 * settings.max_upload_bytes)
    headers = {**UPLOAD_TYPE, **(H(key) if key else {})}
    resp = send(settings, "/v1/files", body, headers)
    assert resp.status_code == 401, resp.text
    assert resp.json()["error"]["type"] == "authentication_error"
    assert body.pulled == 0
    assert spools == [] and stored_files(settings) == []


def test_unauthenticated_json_body_is_not_read(settings: Settings) -> None:
    body = json_body("suffix", 4 * settings.max_json_body_bytes, model=TINY)
    resp = send(settings, "/v1/fine_tuning/jobs", body, JSON_TYPE)
    assert resp.status_code == 401 and body.pulled == 0


def test_oversize_json_body_is_stopped_while_reading(settings: Settings, key_a: str) -> None:
    limit = settings.max_json_body_bytes
    body = json_body("metadata_note", 20 * limit, model=TINY, training_file="file-x")
    resp = send(settings, "/v1/fine_tuning/jobs", body, {**H(key_a), **JSON_TYPE})
    assert resp.status_code == 413, resp.text
    error = resp.json()["error"]
    assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error"
    assert str(limit) in error["message"] and "TUNEFLEET_MAX_JSON_BODY_BYTES" in error["message"]
    assert body.pulled <= limit + CHUNK


def test_declared_length_over_the_limit_is_refused_unread(settings: Settings, key_a: str) -> None:
    body = json_body("suffix", 2 * settings.max_json_body_bytes, model=TINY)
    headers = {**H(key_a), **JSON_TYPE, "Content-Length": str(body.total)}
    resp = send(settings, "/v1/plans", body, headers)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"
    assert body.pulled == 0


def test_chat_has_its_own_larger_limit(settings: Settings, key_a: str) -> None:
    settings = settings.model_copy(
        update={"max_json_body_bytes": 100_000, "max_inference_body_bytes": 1_000_000}
    )
    # over the control routes' limit, within the chat limit: read, then refused by model
    body = json_body("user", 500_000, model="no-such-model", messages=[])
    resp = send(settings, "/v1/chat/completions", body, {**H(key_a), **JSON_TYPE})
    assert resp.status_code == 404, resp.text
    assert body.pulled == body.total
    body = json_body("user", 5_000_000, model="no-such-model", messages=[])
    resp = send(settings, "/v1/chat/completions", body, {**H(key_a), **JSON_TYPE})
    assert resp.status_code == 413, resp.text
    assert "TUNEFLEET_MAX_INFERENCE_BODY_BYTES" in resp.json()["error"]["message"]
    assert body.pulled <= 1_000_000 + CHUNK
