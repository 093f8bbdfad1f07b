"""A node's copies of artifacts from object storage, within a byte budget.

Every process of a node that needs an artifact as files (a run's training file, an
adapter a replica loads, a merged model) gets it through ``NodeCache.fill``: downloaded
once into a temporary name and renamed into place, so a partial download is never
visible, and concurrent fills of one key, in any process of the node, are one download
that the others wait for (a lock file per key). Before a download, the least recently
used copies are deleted until the new one fits in ``budget_bytes``; a copy in use is
never deleted: a process using one holds a ``Pin`` (a shared lock on the copy's entry
file, which a crash of that process releases), and eviction skips whatever it cannot
lock exclusively. Entries (``.entries/``) name each copy's key and size; their mtime is
the last use. When every copy is pinned, a download goes over the budget, and says so.

The cache folder is this user's alone (``artifacts.private_dir``), and the budget is the
chart's cache volume less a margin (``Settings.artifact_cache_size``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class CacheTooSmall(RuntimeError):
    """An artifact larger than the whole cache budget."""


@dataclass
class Pin:
    """A copy in use: not evicted until ``release``d (or its process ends)."""

    path: Path
    _fd: int

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # the shared lock goes with it
            self._fd = -1

    def __enter__(self) -> Path:
        return self.path

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass(frozen=True)
class Usage:
    """What the cache holds: bytes in all and in pinned copies, copies, the budget."""

    bytes: int
    pinned_bytes: int
    copies: int
    budget_bytes: int


class NodeCache:
    """Copies under ``root``, keyed by artifact key, within ``budget_bytes``."""

    def __init__(self, root: Path, budget_bytes: int):
        self.root = root
        self.budget_bytes = budget_bytes
        for sub in (".entries", ".locks", ".tmp"):
            (root / sub).mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        resolved = (self.root / key).resolve()
        if not resolved.is_relative_to(self.root.resolve()) or key.startswith("."):
            raise ValueError(f"artifact key {key!r} escapes the node cache")
        return resolved

    def _digest(self, key: str) -> str:
        return hashlib.sha256(key.encode()).hexdigest()[:32]

    def _entry(self, key: str) -> Path:
        return self.root / ".entries" / self._digest(key)

    @contextlib.contextmanager
    def _locked(self, key: str, blocking: bool = True) -> Iterator[bool]:
        """The key's fill lock (every process of the node): True when held."""
        fd = os.open(self.root / ".locks" / self._digest(key), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)

    def fill(
        self,
        key: str,
        download: Callable[[Path], None],
        size: Callable[[], int],
        pin: bool = False,
    ) -> tuple[Path, Pin | None]:
        """The copy of ``key``: at once if here, else ``download(tmp)`` writes it (a file,
        or a folder) after eviction made room for ``size()`` bytes. With ``pin``, the
        copy is pinned before it is handed over (nothing can evict it in between)."""
        target = self.path(key)
        with self._locked(key):
            if not (target.exists() and self._entry(key).exists()):
                needed = size()
                if needed > self.budget_bytes:
                    raise CacheTooSmall(
                        f"{key} is {needed} bytes, more than the node's artifact cache of "
                        f"{self.budget_bytes} bytes; raise TUNEFLEET_ARTIFACT_CACHE_SIZE "
                        "(the chart's artifacts.cacheSize)"
                    )
                self._make_room(needed, keep=key)
                self._remove(key)  # a copy without its entry: a crash mid-rename
                tmp = self.root / ".tmp" / uuid.uuid4().hex
                try:
                    download(tmp)
                    self._write_entry(key, _size_of(tmp))
                    target.parent.mkdir(parents=True, exist_ok=True)
                    os.rename(tmp, target)
                finally:
                    _remove_path(tmp)
            entry = self._entry(key)
            os.utime(entry)  # used now: the most recent
            held = None
            if pin:
                fd = os.open(entry, os.O_RDONLY)
                fcntl.flock(fd, fcntl.LOCK_SH)
                held = Pin(target, fd)
        return target, held

    def adopt(self, key: str) -> None:
        """Count a copy put under ``path(key)`` by its writer (an upload's spool)."""
        with self._locked(key):
            if self.path(key).exists() and not self._entry(key).exists():
                self._write_entry(key, _size_of(self.path(key)))
        self._make_room(0)

    def forget(self, key: str) -> None:
        """Delete ``key``'s copy (its artifact was deleted or replaced)."""
        with self._locked(key):
            self._remove(key)

    def usage(self) -> Usage:
        total = pinned = copies = 0
        for entry, meta in self._entries():
            total += meta["bytes"]
            copies += 1
            pinned += meta["bytes"] if _pinned(entry) else 0
        return Usage(total, pinned, copies, self.budget_bytes)

    # --- eviction

    def _write_entry(self, key: str, size: int) -> None:
        entry = self._entry(key)
        tmp = entry.with_suffix(".tmp")
        tmp.write_text(json.dumps({"key": key, "bytes": size}))
        os.rename(tmp, entry)

    def _entries(self) -> list[tuple[Path, dict[str, Any]]]:
        found = []
        for entry in (self.root / ".entries").iterdir():
            if entry.suffix == ".tmp":
                continue
            try:
                found.append((entry, json.loads(entry.read_text()), entry.stat().st_mtime))
            except (OSError, ValueError):  # deleted meanwhile
                continue
        found.sort(key=lambda f: f[2])  # least recently used first
        return [(entry, meta) for entry, meta, _ in found]

    def _make_room(self, needed: int, keep: str = "") -> None:
        """Evict least recently used copies until ``needed`` more bytes fit."""
        entries = self._entries()
        total = sum(meta["bytes"] for _, meta in entries)
        for entry, meta in entries:
            if total + needed <= self.budget_bytes:
                return
            key = meta["key"]
            if key == keep:
                continue
            with self._locked(key, blocking=False) as held:
                if not held:  # being filled or evicted elsewhere
                    continue
                fd = os.open(entry, os.O_RDONLY)
                try:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:  # pinned: in use
                        continue
                    self._remove(key)
                    total -= meta["bytes"]
                    log.info(
                        "evicted %s (%d bytes) from the node's artifact cache", key, meta["bytes"]
                    )
                finally:
                    os.close(fd)
        if total + needed > self.budget_bytes:
            log.warning(
                "the node's artifact cache holds %d bytes in use and needs %d more: over its "
                "budget of %d bytes until some are released; raise "
                "TUNEFLEET_ARTIFACT_CACHE_SIZE (the chart's artifacts.cacheSize)",
                total,
                needed,
                self.budget_bytes,
            )

    def _remove(self, key: str) -> None:
        """Delete the copy and its entry (under the key's lock): renamed aside first, so
        no reader finds half of it."""
        target = self.path(key)
        if target.exists():
            aside = self.root / ".tmp" / uuid.uuid4().hex
            os.rename(target, aside)
            _remove_path(aside)
        self._entry(key).unlink(missing_ok=True)


def _pinned(entry: Path) -> bool:
    try:
        fd = os.open(entry, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _size_of(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size if path.exists() else 0


def _remove_path(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
