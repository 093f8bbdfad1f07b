"""``/v1/files``: upload (streamed to the artifact store, validated), list, get, content,
delete. A file that fails validation is not kept."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated, Any, Literal

import anyio.to_thread
from fastapi import APIRouter, Form, Query, UploadFile
from fastapi.responses import StreamingResponse
from sqlalchemy import delete, exists, or_, select

from tunefleet.api._deps import PrincipalDep, SessionDep, SettingsDep, StoreDep
from tunefleet.api._openapi import Deleted, FileList, FileObject, errors, ok
from tunefleet.platform.adapter_import import CONFIG, WEIGHTS, unpack_archive
from tunefleet.platform.datasets import raise_for_report, validate_file
from tunefleet.platform.db import File, Job, now_s
from tunefleet.platform.db.paging import ordered_after
from tunefleet.platform.errors import Conflict, InvalidFile, InvalidRequest, NotFound
from tunefleet.platform.eval_runs import read_jsonl
from tunefleet.platform.ids import new_id
from tunefleet.platform.model_check import read_json, tensor_header
from tunefleet.platform.status import TERMINAL

router = APIRouter(prefix="/v1/files", tags=["files"])
PURPOSES = {"fine-tune", "adapter", "evals"}
MAX_FILENAME = 512  # files.filename's column


def file_view(f: File) -> dict[str, Any]:
    return {
        "id": f.id,
        "object": "file",
        "bytes": f.bytes,
        "created_at": f.created_at,
        "filename": f.filename,
        "purpose": f.purpose,
        "status": f.status,
        "status_details": None,
        "tunefleet": {"format": f.format, "stats": f.stats},
    }


def _get(session: SessionDep, principal: PrincipalDep, file_id: str) -> File:
    f = session.get(File, file_id)
    if f is None or f.tenant_id != principal.tenant_id:
        raise NotFound(f"no file with id {file_id!r}", param="file_id")
    return f


def _eval_rows(path: Path, filename: str) -> int:
    """How many items an ``evals`` file holds: JSONL lines ``{"item": {...}}`` (a
    ``sample`` too for jsonl runs), checked against an eval's schema when a run reads it."""
    try:
        rows = read_jsonl(path.read_text(encoding="utf-8"), filename)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidFile(f"{filename} is not a valid evals file: {exc}", param="file") from None
    for n, row in enumerate(rows, 1):
        if not isinstance(row, dict) or not isinstance(row.get("item"), dict):
            raise InvalidFile(
                f'{filename} is not a valid evals file: item {n} is not {{"item": {{...}}}}',
                param="file",
            )
    return len(rows)


def _adapter_stats(archive: Path, max_bytes: int) -> dict[str, Any]:
    """An adapter archive's checks that need no base model (it is checked against its base
    on import, ``POST /v1/models``): it unpacks safely to a peft adapter folder."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = unpack_archive(archive, Path(tmp), max_bytes=max_bytes)
        config = read_json(folder / CONFIG, param="file")
        if not (folder / WEIGHTS).is_file() or not isinstance(config, dict):
            raise InvalidRequest(
                f"the archive holds no {WEIGHTS} beside {CONFIG}; pack the folder peft's "
                "save_pretrained(safe_serialization=True) writes",
                param="file",
                code="invalid_adapter",
            )
        tensor_header(folder / WEIGHTS, param="file")
        return {"r": config.get("r"), "target_modules": config.get("target_modules"),
                "base_model_name_or_path": config.get("base_model_name_or_path")}  # fmt: skip


@router.post("", responses=ok(FileObject))
async def upload_file(
    file: UploadFile,
    purpose: Annotated[str, Form()],
    session: SessionDep,
    principal: PrincipalDep,
    store: StoreDep,
    settings: SettingsDep,
) -> dict[str, Any]:
    if purpose not in PURPOSES:
        raise InvalidRequest(
            f"purpose {purpose!r} is not supported; use 'fine-tune' (JSONL training data), "
            "'evals' (JSONL items of eval runs) or 'adapter' (a peft adapter's folder as "
            ".tar or .zip)",
            param="purpose",
        )
    filename = file.filename or ("upload.jsonl" if purpose == "fine-tune" else "adapter.tar")
    archive = purpose == "adapter"
    if archive and not filename.lower().endswith((".tar", ".zip", ".tar.gz", ".tgz")):
        raise InvalidRequest(
            f"file {filename[:80]!r}: an adapter is uploaded as a .tar, .tar.gz or .zip of "
            "the folder peft's save_pretrained writes",
            param="file",
        )
    if len(filename) > MAX_FILENAME or "\x00" in filename:
        shown = repr(filename[:40]) + ("..." if len(filename) > 40 else "")
        raise InvalidRequest(
            f"file name {shown} ({len(filename)} characters) is not accepted; rename the "
            f"file to at most {MAX_FILENAME} characters, without NUL characters",
            param="file",
        )
    file_id = new_id("file")
    key = store.archive_key(file_id) if archive else store.file_key(file_id)

    async def chunks() -> Any:
        while chunk := await file.read(1 << 20):
            yield chunk

    size = await store.write_stream(key, chunks(), settings.max_upload_bytes)
    try:
        # Reading a file of up to max_upload_bytes is real work: off the event loop.
        fmt: str | None
        if archive:
            fmt = "peft_lora"
            stats = await anyio.to_thread.run_sync(
                _adapter_stats, store.local_copy(key), settings.max_upload_bytes
            )
        elif purpose == "evals":
            fmt = "evals_jsonl"
            rows = await anyio.to_thread.run_sync(_eval_rows, store.local_copy(key), filename)
            stats = {"items": rows}
        else:
            report = await anyio.to_thread.run_sync(validate_file, store.local_copy(key))
            raise_for_report(report, filename)
            fmt, stats = report.format, {"examples": report.examples}
        row = File(
            id=file_id,
            tenant_id=principal.tenant_id,
            filename=filename,
            purpose=purpose,
            bytes=size,
            status="processed",
            format=fmt,
            stats=stats,
            path=key,
            created_at=now_s(),
        )
        session.add(row)
        session.commit()
    except BaseException:
        store.delete(key)
        raise
    return file_view(row)


@router.get("", responses={**ok(FileList), **errors(404)})
async def list_files(
    session: SessionDep,
    principal: PrincipalDep,
    purpose: str | None = None,
    after: Annotated[str | None, Query(description="A file id: list the files after it.")] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    order: Literal["asc", "desc"] = "desc",
) -> dict[str, Any]:
    """The caller's files by ``created_at``, then id (a total order, so ``after`` pages
    neither skip nor repeat a file), newest first unless ``order=asc``; OpenAI's bounds."""
    query = select(File).where(File.tenant_id == principal.tenant_id)
    if purpose:
        query = query.where(File.purpose == purpose)
    anchor = None
    if after:
        found = session.get(File, after)
        if found is None or found.tenant_id != principal.tenant_id:
            raise NotFound(f"no file with id {after!r} to list after", param="after")
        anchor = (found.created_at, found.id)
    paged = ordered_after(query, File.created_at, File.id, anchor, descending=order == "desc")
    rows = list(session.scalars(paged.limit(limit + 1)))
    return {
        "object": "list",
        "data": [file_view(f) for f in rows[:limit]],
        "has_more": len(rows) > limit,
    }


@router.get("/{file_id}", responses={**ok(FileObject), **errors(404)})
async def get_file(file_id: str, session: SessionDep, principal: PrincipalDep) -> dict[str, Any]:
    return file_view(_get(session, principal, file_id))


@router.get(
    "/{file_id}/content",
    response_class=StreamingResponse,
    responses={
        **ok(
            {
                "content": {
                    "application/jsonl": {"schema": {"type": "string"}},
                    "text/csv": {"schema": {"type": "string"}},
                }
            },
            "The file: JSONL, or the CSV of a job's step metrics (purpose fine-tune-results).",
        ),
        **errors(404),
    },
)
def file_content(
    file_id: str, session: SessionDep, principal: PrincipalDep, store: StoreDep
) -> StreamingResponse:
    f = _get(session, principal, file_id)
    media = {"csv": "text/csv", "peft_lora": "application/octet-stream"}.get(
        f.format or "", "application/jsonl"
    )
    return StreamingResponse(store.read_chunks(f.path), media_type=media)


@router.delete("/{file_id}", responses={**ok(Deleted), **errors(404, 409)})
async def delete_file(
    file_id: str, session: SessionDep, principal: PrincipalDep, store: StoreDep
) -> dict[str, Any]:
    """Delete a file no unfinished job needs (one statement: a job created meanwhile either
    sees the file gone or keeps it); 409 naming the jobs that still need it."""
    path = _get(session, principal, file_id).path
    files, jobs = File.__table__.c, Job.__table__.c
    needs_it = (
        select(jobs.id)
        .where(
            jobs.tenant_id == principal.tenant_id,
            or_(jobs.training_file == file_id, jobs.validation_file == file_id),
            jobs.status.not_in([s.value for s in TERMINAL]),
        )
        .order_by(jobs.created_ns)
    )
    result = session.execute(
        delete(File)
        .where(files.id == file_id, files.tenant_id == principal.tenant_id, ~exists(needs_it))
        .execution_options(synchronize_session=False)
    )
    deleted = getattr(result, "rowcount", 0)
    if not deleted:
        waiting = list(session.scalars(needs_it.limit(5)))
        session.rollback()
        raise Conflict(
            f"file {file_id} is used by unfinished job(s) {', '.join(waiting)}; delete it once "
            "they end, or cancel them first",
            param="file_id",
            code="file_in_use",
        )
    session.commit()
    store.delete(path)
    return {"id": file_id, "object": "file", "deleted": True}
