"""The artifact stores: the local folder replaces folders atomically and leaves nothing
behind when a write fails (a full disk); the local folder and S3 (a real S3 server) keep
the same things under the same keys, and an oversize upload leaves nothing in either."""

from __future__ import annotations

import asyncio
import errno
import os
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tunefleet.platform.artifacts import ArtifactStore, S3Store, Store, open_store
from tunefleet.platform.errors import InvalidRequest, PayloadTooLarge


def _version(root: Path, n: int) -> Path:
    folder = root / f"v{n}"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(f'{{"version": {n}}}')
    (folder / "adapter_model.safetensors").write_bytes(b"w" * 4096)
    return folder


def _leftovers(store: ArtifactStore) -> list[str]:
    return sorted(p.name for p in (store.root / "adapters").iterdir() if p.name.startswith("."))


def test_put_dir_never_shows_a_reader_a_missing_folder(tmp_path: Path) -> None:
    """The old put_dir removed the folder, then renamed the new one in: a reader (a Serve
    replica loading the adapter) could find nothing in between."""
    store = ArtifactStore(tmp_path / "store")
    key = store.adapter_key("job-1")
    store.put_dir(key, _version(tmp_path, 0))
    final = store.path(key)
    missing: list[int] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            if not (final / "adapter_config.json").exists():
                missing.append(1)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for n in range(1, 200):
            store.put_dir(key, _version(tmp_path, n))
    finally:
        done.set()
        reader.join()
    assert missing == []
    assert (final / "adapter_config.json").read_text() == '{"version": 199}'
    assert _leftovers(store) == []


def test_a_full_disk_keeps_the_old_folder_and_no_temporary_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ArtifactStore(tmp_path / "store")
    key = store.adapter_key("job-1")
    store.put_dir(key, _version(tmp_path, 1))
    sent: list[int] = []
    sendfile = os.sendfile

    def fill_up(out_fd: int, in_fd: int, offset: int | None, count: int) -> int:
        if sent:  # the second file's write finds the disk full
            raise OSError(errno.ENOSPC, "No space left on device")
        sent.append(count)
        return sendfile(out_fd, in_fd, offset, count)

    monkeypatch.setattr(os, "sendfile", fill_up)
    with pytest.raises(OSError, match="No space left on device"):
        store.put_dir(key, _version(tmp_path, 2))
    monkeypatch.undo()
    assert (store.path(key) / "adapter_config.json").read_text() == '{"version": 1}'
    assert (store.path(key) / "adapter_model.safetensors").stat().st_size == 4096
    assert _leftovers(store) == []

    def full(self: Path, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device", str(self))

    monkeypatch.setattr(Path, "write_bytes", full)
    with pytest.raises(OSError):
        store.write_bytes("adapters/note.txt", b"x")
    assert _leftovers(store) == []


@pytest.fixture(params=["local", "s3"])
def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    """Each kind of artifact store: a local folder, and a bucket on a real S3 server."""
    if request.param == "local":
        return open_store(str(tmp_path / "store"))
    from s3 import new_bucket

    endpoint = request.getfixturevalue("s3_endpoint")
    return open_store(new_bucket(endpoint), endpoint_url=endpoint, cache_dir=tmp_path / "cache")


def test_both_stores_keep_files_and_folders_under_their_keys(
    any_store: Store, tmp_path: Path
) -> None:
    store = any_store
    key = store.file_key("file-1")
    assert not store.exists(key)
    store.write_bytes(key, b'{"a": 1}\n' * 1000)
    assert store.exists(key)
    assert b"".join(store.read_chunks(key, chunk_size=100)) == b'{"a": 1}\n' * 1000
    assert store.local_copy(key).read_bytes() == b'{"a": 1}\n' * 1000

    adapter = store.adapter_key("ftjob-1")
    store.put_dir(adapter, _version(tmp_path, 1))
    store.put_dir(adapter, _version(tmp_path, 2))  # replaced whole
    copy = store.local_copy(adapter)
    assert sorted(p.name for p in copy.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert (copy / "adapter_config.json").read_text() == '{"version": 2}'
    store.delete(adapter)
    store.delete(key)
    assert not store.exists(adapter) and not store.exists(key)
    with pytest.raises(InvalidRequest, match="escapes the store root"):
        store.exists("../outside")


def test_an_oversize_upload_leaves_nothing_in_either_store(any_store: Store) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(10):
            yield b"x" * 1000

    with pytest.raises(PayloadTooLarge, match="exceeds the limit of 5000 bytes"):
        asyncio.run(any_store.write_stream("files/big.jsonl", chunks(), max_bytes=5000))
    assert not any_store.exists("files/big.jsonl")
    assert (
        asyncio.run(any_store.write_stream("files/ok.jsonl", chunks(), max_bytes=10_000)) == 10_000
    )
    assert any_store.local_copy("files/ok.jsonl").stat().st_size == 10_000


def test_s3_writes_leave_no_temporary_objects_and_copies_come_from_the_bucket(
    s3_endpoint: str, tmp_path: Path
) -> None:
    """Temporary keys are gone after every write; a process on another node (its own
    cache) gets its copies from the bucket; Ray Train is given the bucket's path and
    filesystem for checkpoints."""
    from pyarrow import fs

    from s3 import new_bucket

    url = new_bucket(s3_endpoint)
    writer = open_store(url, endpoint_url=s3_endpoint, cache_dir=tmp_path / "a")
    writer.write_bytes("files/f.jsonl", b"line\n")
    writer.put_dir("adapters/ftjob-1", _version(tmp_path, 1))
    assert isinstance(writer, S3Store)
    bucket_root = writer.base.split("/", 1)[0]
    listed = writer.fs.get_file_info(fs.FileSelector(bucket_root, recursive=True))
    files = sorted(i.path for i in listed if i.type == fs.FileType.File)
    assert files == [
        f"{writer.base}/adapters/ftjob-1/adapter_config.json",
        f"{writer.base}/adapters/ftjob-1/adapter_model.safetensors",
        f"{writer.base}/files/f.jsonl",
    ]
    reader = open_store(url, endpoint_url=s3_endpoint, cache_dir=tmp_path / "b")
    assert reader.local_copy("files/f.jsonl").read_bytes() == b"line\n"
    assert reader.local_copy("files/f.jsonl").is_relative_to(tmp_path / "b")
    path, filesystem = reader.ray_storage(reader.CHECKPOINTS)
    assert path == f"{writer.base}/checkpoints" and isinstance(filesystem, fs.S3FileSystem)
    with pytest.raises(FileNotFoundError, match="not in s3://"):
        reader.local_copy("adapters/ftjob-missing")
