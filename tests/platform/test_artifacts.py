"""The artifact store replaces folders atomically and leaves nothing behind when a write
fails (a full disk)."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest

from tunefleet.platform.artifacts import ArtifactStore


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
