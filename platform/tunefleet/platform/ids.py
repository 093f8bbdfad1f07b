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
    "webhook": "whep",
    "delivery": "whdlv",
    "webhook_event": "evt",
    "audit": "audit",
    "eval": "eval",
    "eval_run": "evalrun",
    "output_item": "outputitem",
}


def new_id(kind: str, length: int = 24) -> str:
    """A fresh id such as ``ftjob-3fA9...``: ``length`` base-62 characters (about 143
    random bits at the default) after the prefix of ``kind``, a key of ``PREFIXES``."""
    n = int.from_bytes(secrets.token_bytes(length))
    chars = []
    for _ in range(length):
        n, r = divmod(n, 62)
        chars.append(_ALPHABET[r])
    return f"{PREFIXES[kind]}-{''.join(chars)}"
