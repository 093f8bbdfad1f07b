"""The artifact store: uploads, checkpoints, adapters and merged models, under keys.

Keys are relative POSIX paths. Two stores answer the same calls (``open_store`` picks one
from ``TUNEFLEET_ARTIFACT_ROOT``):

- ``ArtifactStore``, a local folder (the embedded default; a ReadWriteMany volume in
  Kubernetes). Writes go to a temporary name and are renamed into place, so a crash never
  leaves a half-written artifact under its final key.
- ``S3Store``, S3-compatible object storage (``s3://bucket/prefix``; AWS, MinIO, GCS's
  interoperability endpoint) through pyarrow's filesystem layer, the one Ray Train writes
  checkpoints with. Writes go to a temporary key and are copied into place server-side.
  A process that needs an artifact as files (a run's training file, an adapter a replica
  loads) gets a copy in its node's cache (``local_copy``, ``node_cache``: one download per
  node, within a byte budget, least recently used copies evicted, never one in use):
  uploads, adapters and merged models are written once under their keys, so a copy does
  not go stale. Objects up to 5 GB (S3's limit of one server-side copy).
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import hashlib
import os
import shutil
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from tunefleet.platform.errors import InvalidRequest, PayloadTooLarge
from tunefleet.platform.node_cache import NodeCache, Pin
from tunefleet.platform.settings import Settings

DEFAULT_CACHE_SIZE = Settings.model_fields["artifact_cache_size"].default

# one read or write to object storage; small reads cost a request each
_CHUNK = 8 << 20


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


class Keys:
    """Keys by kind, so every process agrees on where things live."""

    @staticmethod
    def file_key(file_id: str) -> str:
        return f"files/{file_id}.jsonl"

    @staticmethod
    def archive_key(file_id: str) -> str:
        """An uploaded archive (purpose ``adapter``: a peft adapter's folder)."""
        return f"files/{file_id}.archive"

    @staticmethod
    def results_key(file_id: str) -> str:
        """A job's results file (``platform/results.py``), beside the uploads."""
        return f"files/{file_id}.csv"

    @staticmethod
    def adapter_key(job_id: str) -> str:
        return f"adapters/{job_id}"

    @staticmethod
    def merged_key(job_id: str) -> str:
        return f"merged/{job_id}"

    @staticmethod
    def serving_key(base_model: str) -> str:
        """The serving configuration of a base model as the controller last pushed it, for
        a replica starting up to apply before it takes traffic (``LoraServer``). The one
        key written over and over: read it with ``read_chunks``, never ``local_copy``."""
        digest = hashlib.sha256(base_model.encode()).hexdigest()[:16]
        return f"serving/{digest}.json"

    CHECKPOINTS = "checkpoints"  # Ray Train's storage_path: {job}/step-N below it
    CHECKPOINT_WEIGHTS = "adapter"  # a checkpoint's weights, in its folder

    @classmethod
    def checkpoints_key(cls, job_id: str) -> str:
        return f"{cls.CHECKPOINTS}/{job_id}"

    @staticmethod
    def checkpoint_name(step: int) -> str:
        """The folder of a job's checkpoint at ``step``, below ``checkpoints_key``."""
        return f"step-{step:08d}"

    @classmethod
    def checkpoint_key(cls, job_id: str, step: int) -> str:
        return f"{cls.checkpoints_key(job_id)}/{cls.checkpoint_name(step)}"


class ArtifactStore(Keys):
    """The local folder ``root``."""

    def __init__(self, root: Path):
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)

    @property
    def location(self) -> str:
        """What ``TUNEFLEET_ARTIFACT_ROOT`` names this store by."""
        return str(self.root)

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

    def put_dir(self, key: str, source: Path) -> None:
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

    def delete(self, key: str) -> None:
        target = self.path(key)
        if target.is_dir():
            shutil.rmtree(target)
        else:
            target.unlink(missing_ok=True)

    def local_copy(self, key: str) -> Path:
        """The artifact as a local file or folder: here, itself."""
        return self.path(key)

    def pinned_copy(self, key: str) -> Pin:
        """``local_copy`` (no cache here: nothing to keep from eviction)."""
        return Pin(self.path(key), -1)

    def ray_storage(self, key: str) -> tuple[str, Any]:
        """``(storage_path, storage_filesystem)`` for Ray Train's ``RunConfig``."""
        return str(self.path(key)), None


class S3Store(Keys):
    """S3-compatible object storage under ``s3://bucket/prefix``. Credentials come from
    the process's environment as every AWS client reads them (``AWS_ACCESS_KEY_ID`` and
    ``AWS_SECRET_ACCESS_KEY``, a web identity, an instance profile), never from TuneFleet's
    settings, so nothing passes them to Ray."""

    def __init__(
        self, url: str, *, endpoint_url: str, region: str, cache_dir: Path, cache_size: int
    ):
        from pyarrow import fs

        parsed = urlparse(url)
        if parsed.scheme != "s3" or not parsed.netloc:
            raise ValueError(f"artifact root {url!r} is not s3://bucket[/prefix]")
        self.url = url.rstrip("/")
        self.base = f"{parsed.netloc}/{parsed.path.strip('/')}".rstrip("/")
        options: dict[str, Any] = {"region": region or "us-east-1"}
        if endpoint_url:
            endpoint = urlparse(endpoint_url)
            options.update(endpoint_override=endpoint.netloc, scheme=endpoint.scheme or "https")
        self.fs = fs.S3FileSystem(**options)
        # this node's copies (``local_copy``), apart from other stores' copies, readable by
        # this user alone
        private_dir(cache_dir, setting="TUNEFLEET_ARTIFACT_CACHE")
        self.cache = ArtifactStore(cache_dir / hashlib.sha256(self.url.encode()).hexdigest()[:16])
        self.node_cache = NodeCache(self.cache.root, budget_bytes=int(0.9 * cache_size))
        self.fetched = Fetched()

    @property
    def location(self) -> str:
        return self.url

    def _object(self, key: str) -> str:
        parts = Path(key).parts
        if Path(key).is_absolute() or ".." in parts or not parts:
            raise InvalidRequest(f"artifact key {key!r} escapes the store root")
        return f"{self.base}/{'/'.join(parts)}"

    def exists(self, key: str) -> bool:
        from pyarrow import fs

        return bool(self.fs.get_file_info(self._object(key)).type != fs.FileType.NotFound)

    def _upload(self, key: str, local: Path) -> None:
        """Upload a file under a temporary key, then copy it into place server-side: an
        upload cut short never shows under ``key`` (S3 completes an object even when its
        writer fails)."""
        tmp = self._object(f".tmp/{uuid.uuid4().hex}")
        try:
            _copy_up(self.fs, local, tmp)
            self.fs.move(tmp, self._object(key))
        finally:
            _forget(self.fs, tmp)

    async def write_stream(self, key: str, chunks: AsyncIterator[bytes], max_bytes: int) -> int:
        """Spooled to the local cache (bounded as the local store bounds it), uploaded,
        and kept there as the key's local copy (the upload's validation reads it)."""
        size = await self.cache.write_stream(key, chunks, max_bytes)
        try:  # off the event loop: an upload of hundreds of MB holds no other request
            await asyncio.to_thread(self._upload, key, self.cache.path(key))
        except BaseException:
            self.cache.delete(key)
            raise
        await asyncio.to_thread(self.node_cache.adopt, key)
        return size

    def write_bytes(self, key: str, data: bytes) -> None:
        self.cache.write_bytes(key, data)
        self._upload(key, self.cache.path(key))
        self.node_cache.adopt(key)

    def read_chunks(self, key: str, chunk_size: int = 1 << 16) -> Iterator[bytes]:
        with self.fs.open_input_stream(self._object(key)) as fh:
            while chunk := fh.read(max(chunk_size, _CHUNK)):  # a request per read
                yield chunk

    def put_dir(self, key: str, source: Path) -> None:
        """Upload a folder under a temporary prefix, then replace ``key`` with it: the old
        objects go, then the new ones are copied in server-side, one by one (not atomic: a
        reader in between finds the key missing or partly there; TuneFleet writes a key's
        folder once, before anyone reads it, and a replacement is re-fetched only by the
        node that made it). A write cut short leaves objects under ``.tmp/``: expire them
        with a lifecycle rule."""
        from pyarrow import fs

        tmp = self._object(f".tmp/{uuid.uuid4().hex}")
        final = self._object(key)
        try:
            _copy_up(self.fs, source, tmp)
            _forget(self.fs, final)
            for info in self.fs.get_file_info(fs.FileSelector(tmp, recursive=True)):
                if info.type == fs.FileType.File:
                    self.fs.move(info.path, final + info.path[len(tmp) :])
        finally:
            _forget(self.fs, tmp)
        self.node_cache.forget(key)  # a copy of the old folder

    def delete(self, key: str) -> None:
        _forget(self.fs, self._object(key))
        self.node_cache.forget(key)

    def local_copy(self, key: str) -> Path:
        """The artifact in this node's cache (``node_cache``: downloaded once by one of
        the node's processes, the others waiting; within the cache's budget)."""
        return self._fill(key, pin=False)[0]

    def pinned_copy(self, key: str) -> Pin:
        """``local_copy``, kept from eviction until the pin is released."""
        pin = self._fill(key, pin=True)[1]
        assert pin is not None
        return pin

    def _fill(self, key: str, pin: bool) -> tuple[Path, Pin | None]:
        """One listing finds a folder's files (and their size, for the cache to make
        room), which download side by side in large reads (an adapter's cold load on a
        replica waits for this)."""
        from pyarrow import fs

        remote = self._object(key)
        plan: list[tuple[str, str]] = []  # (object, path under the copy; "" for a file)

        def size() -> int:
            listing = self.fs.get_file_info(
                fs.FileSelector(remote, recursive=True, allow_not_found=True)
            )
            files = [info for info in listing if info.type == fs.FileType.File]
            if not files and not listing:  # not a folder: a file, or nothing
                info = self.fs.get_file_info(remote)
                if info.type != fs.FileType.File:
                    raise FileNotFoundError(f"{key} is not in {self.url}")
                files, plan[:] = [info], [(remote, "")]
            else:
                plan[:] = [(info.path, info.path[len(remote) + 1 :]) for info in files]
            return sum(info.size for info in files)

        def download(tmp: Path) -> None:
            if plan and plan[0][1] == "":
                self._download(remote, tmp)
                return
            tmp.mkdir()  # a folder (maybe of empty folders only)
            with ThreadPoolExecutor(max_workers=min(8, max(1, len(plan)))) as pool:
                list(pool.map(lambda copy: self._download(copy[0], tmp / copy[1]), plan))

        return self.node_cache.fill(key, download, size, pin=pin)

    def _download(self, remote: str, local: Path) -> None:
        local.parent.mkdir(parents=True, exist_ok=True)
        with self.fs.open_input_file(remote) as source, open(local, "wb") as sink:
            size = source.size()  # ranged reads of a known size: one request each
            for offset in range(0, size, _CHUNK):
                data = source.read_at(min(_CHUNK, size - offset), offset)
                sink.write(data)
                self.fetched.add(len(data))
        self.fetched.add(0, objects=1)

    def ray_storage(self, key: str) -> tuple[str, Any]:
        return self._object(key), self.fs


class Fetched:
    """What a store has read from object storage into its node's cache: bytes and
    objects (a cold load's own counters, apart from the wall clock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes = 0
        self.objects = 0

    def add(self, n: int, objects: int = 0) -> None:
        with self._lock:
            self.bytes += n
            self.objects += objects


def private_dir(path: Path, *, setting: str) -> None:
    """Make ``path`` a folder of this user's alone, or refuse one that is not (a shared
    temporary folder where another user could have planted files); ``setting`` names
    where it comes from."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.lstat()
    if path.is_symlink() or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(
            f"the cache {path} must be a folder of this user's alone (mode 0700); "
            f"remove it or set {setting} elsewhere"
        )


def _copy_up(filesystem: Any, local: Path, remote: str) -> None:
    """A local file or folder to ``remote``."""
    from pyarrow import fs

    fs.copy_files(
        str(local),
        remote,
        source_filesystem=fs.LocalFileSystem(),
        destination_filesystem=filesystem,
        chunk_size=_CHUNK,
    )


def _forget(filesystem: Any, remote: str) -> None:
    """Remove an object or every object under a prefix; nothing there is fine."""
    from pyarrow import fs

    info = filesystem.get_file_info(remote)
    if info.type == fs.FileType.File:
        filesystem.delete_file(remote)
    elif info.type == fs.FileType.Directory:
        filesystem.delete_dir(remote)


Store = ArtifactStore | S3Store


def artifact_store(settings: Settings) -> Store:
    """This process's artifact store, as its settings name it."""
    return open_store(
        settings.artifact_location,
        endpoint_url=settings.s3_endpoint_url,
        region=settings.s3_region,
        **cache_of(settings),
    )


def cache_of(settings: Settings) -> dict[str, Any]:
    """``open_store``'s node cache arguments, as this process's settings say."""
    return {
        "cache_dir": settings.resolved_artifact_cache,
        "cache_size": settings.artifact_cache_size,
    }


def open_store(
    location: str,
    *,
    endpoint_url: str = "",
    region: str = "",
    cache_dir: Path | None = None,
    cache_size: int = DEFAULT_CACHE_SIZE,
) -> Store:
    """The store ``location`` names: ``s3://bucket/prefix`` or a local folder."""
    if location.startswith("s3://"):
        if cache_dir is None:
            raise ValueError("an object-storage artifact store needs a local cache folder")
        return S3Store(
            location,
            endpoint_url=endpoint_url,
            region=region,
            cache_dir=cache_dir,
            cache_size=cache_size,
        )
    return ArtifactStore(Path(location))
