"""Secrets made once per data folder and kept there, readable by their owner alone: what
the processes of the embedded default share when no setting names a secret (the Serve
secret, the dashboard's session-signing key)."""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
from pathlib import Path


@functools.lru_cache(maxsize=16)
def persisted_secret(data_dir: Path, name: str) -> str:
    """The secret in ``data_dir/name``, made (32 random bytes, URL-safe) and written with
    mode 0600 the first time it is asked for; two processes racing to make it agree on
    the first one written."""
    path = data_dir / name
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{name}.{secrets.token_hex(4)}")
        tmp.touch(mode=0o600)
        tmp.write_text(secrets.token_urlsafe(32))
        with contextlib.suppress(FileExistsError):  # two processes racing: the first wins
            os.link(tmp, path)
        tmp.unlink()
    return path.read_text().strip()
