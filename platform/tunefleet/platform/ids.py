"""Identifiers: a short prefix naming the kind (OpenAI style) and a random url-safe part."""

from __future__ import annotations

import secrets
import string

_ALPHABET = string.ascii_letters + string.digits

PREFIXES = {
    "file": "file",
    "job": "ftjob",
    "event": "ftevent",
    "checkpoint": "ftckpt",
    "tenant": "tenant",
    "key": "key",
    "adapter": "adapter",
}


def new_id(kind: str, length: int = 24) -> str:
    """A fresh id such as ``ftjob-3fA9...``; ``kind`` is a key of ``PREFIXES``."""
    body = "".join(secrets.choice(_ALPHABET) for _ in range(length))
    return f"{PREFIXES[kind]}-{body}"
