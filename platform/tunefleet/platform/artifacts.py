"""The artifact store: uploads, checkpoints and adapters under one root folder.

Keys are relative POSIX paths; the root is a local folder, a mounted PVC in Kubernetes.
Writes go to a temporary name and are renamed into place, so a crash never leaves a
half-written artifact under its final key.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

from tunefleet.platform.errors import InvalidRequest, PayloadTooLarge


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``); False
    where the system or the filesystem cannot."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


# Beside the weights of a model a run saved for a method that is not peft LoRA: which
# method (serving refuses to batch it; training reloads by it).
METHOD_FILE = "tunefleet_method.json"


class ArtifactStore:
    def __init__(self, root: Path):
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)

    # Keys by kind, so every process agrees on where things live.
    @staticmethod
    def file_key(file_id: str) -> str:
        return f"files/{file_id}.jsonl"

    @staticmethod
    def adapter_key(job_id: str) -> str:
        return f"adapters/{job_id}"

    @staticmethod
    def merged_key(job_id: str) -> str:
        return f"merged/{job_id}"

    @staticmethod
    def checkpoints_key(job_id: str) -> str:
        return f"checkpoints/{job_id}"

    def path(self, key: str) -> Path:
        resolved = (self.root / key).resolve()
        if not resolved.is_relative_to(self.root.resolve()):
            raise InvalidRequest(f"artifact key {key!r} escapes the store root")
        return resolved

    def exists(self, key: str) -> bool:
        return self.path(key).exists()

    def _tmp_for(self, key: str) -> Path:
        final = self.path(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        return final.with_name(f".{final.name}.{uuid.uuid4().hex}.tmp")

    async def write_stream(self, key: str, chunks: AsyncIterator[bytes], max_bytes: int) -> int:
        """Stream chunks to ``key``; over ``max_bytes`` nothing is kept and 413 is raised."""
        tmp = self._tmp_for(key)
        size = 0
        try:
            with tmp.open("wb") as fh:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > max_bytes:
                        raise PayloadTooLarge(
                            f"upload exceeds the limit of {max_bytes} bytes; split the file or "
                            "raise TUNEFLEET_MAX_UPLOAD_BYTES",
                            param="file",
                        )
                    fh.write(chunk)
            os.replace(tmp, self.path(key))
        finally:
            tmp.unlink(missing_ok=True)
        return size

    def write_bytes(self, key: str, data: bytes) -> None:
        tmp = self._tmp_for(key)
        try:
            tmp.write_bytes(data)
            os.replace(tmp, self.path(key))
        finally:
            tmp.unlink(missing_ok=True)

    def read_chunks(self, key: str, chunk_size: int = 1 << 16) -> Iterator[bytes]:
        with self.path(key).open("rb") as fh:
            while chunk := fh.read(chunk_size):
                yield chunk

    def put_dir(self, key: str, source: Path) -> Path:
        """Copy a folder in under ``key``, replacing what was there atomically: a reader
        sees the old folder or the new one, never a mix or nothing. A failed copy (a full
        disk) leaves the old folder as it was and no temporary folder behind."""
        final = self.path(key)
        tmp = self._tmp_for(key)
        try:
            shutil.copytree(source, tmp)
            if not final.exists():
                os.replace(tmp, final)
            elif _exchange(tmp, final):  # tmp now holds the old folder
                shutil.rmtree(tmp)
            else:  # no atomic exchange here: the key is missing between two renames
                aside = self._tmp_for(key)
                os.replace(final, aside)
                os.replace(tmp, final)
                shutil.rmtree(aside, ignore_errors=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return final

    def delete(self, key: str) -> None:
        target = self.path(key)
        if target.is_dir():
            shutil.rmtree(target)
        else:
            target.unlink(missing_ok=True)
