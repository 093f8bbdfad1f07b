"""Structured outputs: a request's ``response_format`` as a grammar that constrains every
token a row samples, with llguidance (the engine vLLM and SGLang use).

Per request, ``Grammars.compile`` turns the format into a grammar (refusing a schema the
engine cannot follow, with its reason); per row, ``Grammars.matcher`` starts a matcher that
the batch engine advances token by token. At each decode step the engine asks
``fill_masks`` for the allowed tokens of all constrained rows of the batch at once
(whatever adapter each uses: the grammar acts on logits, after the forward pass) and
samples only among them; the end-of-text token is allowed only where the grammar may end.
"""

from __future__ import annotations

import json
import threading
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# The JSON the grammar lets a model write: compact separators and no free whitespace, so
# a row's tokens go to the content, not to spaces (OpenAI's strict mode writes the same).
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
ANY_OBJECT: dict[str, Any] = {"type": "object"}  # response_format json_object
MAX_SCHEMA_CHARS = 64_000


class GrammarError(ValueError):
    """A response format the engine cannot follow; the message says why."""


class Grammars:
    """Grammars of one tokenizer (a replica's): compiled once per distinct format."""

    def __init__(self, tokenizer: Any, eos_ids: set[int]):
        self._hf = tokenizer
        self._eos = sorted(eos_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self.executor = llguidance.LLExecutor()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary (built on first use: ~0.4 s for 49k tokens;
        a replica builds it as it starts); ``GrammarError`` for a tokenizer it cannot read
        (a slow, pure-Python one)."""
        with self._lock:
            if self._tokenizer is None:
                eos = self._eos[0] if len(self._eos) == 1 else (self._eos or None)
                try:
                    self._tokenizer = llguidance.hf.from_tokenizer(self._hf, eos_token=eos)
                except Exception as exc:
                    raise GrammarError(
                        f"structured outputs are not available for this model's tokenizer "
                        f"({type(exc).__name__}: {exc})"
                    ) from exc
            return self._tokenizer

    def compile(self, response_format: dict[str, Any]) -> str | None:
        """The grammar of an OpenAI ``response_format`` (None for plain text); raises
        ``GrammarError`` naming what the engine cannot follow."""
        kind = response_format.get("type")
        if kind in (None, "text"):
            return None
        if kind == "json_object":
            schema: Any = ANY_OBJECT
        elif kind == "json_schema":
            spec = response_format.get("json_schema") or {}
            if not isinstance(spec, dict):
                raise GrammarError("json_schema must be an object with 'name' and 'schema'")
            schema = spec.get("schema", ANY_OBJECT)
            if not isinstance(schema, dict):
                raise GrammarError("json_schema.schema must be a JSON Schema object")
        else:
            raise GrammarError(
                f"response_format type {kind!r} is not supported; use 'text', 'json_object' "
                "or 'json_schema'"
            )
        text = json.dumps(schema)  # key order kept: it is the order the answer writes
        if len(text) > MAX_SCHEMA_CHARS:
            raise GrammarError(
                f"the schema is {len(text)} characters; at most {MAX_SCHEMA_CHARS} are accepted"
            )
        return self._grammar(text)

    @lru_cache(maxsize=256)  # noqa: B019 - one Grammars per replica, for its life
    def _grammar(self, schema: str) -> str:
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        except ValueError as exc:
            raise GrammarError(f"the schema is not valid JSON Schema: {exc}") from exc
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self.tokenizer
        )
        if failed:
            raise GrammarError(f"the schema cannot be followed: {messages[0]}")
        return grammar

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        return llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)

    def token_bytes(self, token: int) -> bytes:
        """A token's bytes (a token can hold part of a character)."""
        try:
            return self.tokenizer.decode_bytes([token])
        except GrammarError:  # no grammar engine for this tokenizer: its own decoding
            return str(self._hf.decode([token])).encode()

    def token_text(self, token: int) -> str:
        """A token as OpenAI's logprobs name it: its text, or ``bytes:\\xNN...`` when it
        holds part of a character."""
        raw = self.token_bytes(token)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def fill_masks(
    grammars: Grammars, matchers: list[tuple[llguidance.LLMatcher, int]], logits: torch.Tensor
) -> None:
    """Set to -inf, in place, every token each ``(matcher, row)`` does not allow next: the
    masks of all rows are computed together (in parallel, off the GIL), then applied with
    plain tensor operations (llguidance's own kernel is ``torch.compile``d: a compiler and
    seconds of compiling in the engine thread, which every tenant's rows wait for)."""
    vocab = logits.shape[1]
    rows = torch.tensor([row for _, row in matchers])
    words = llguidance.torch.allocate_token_bitmask(len(rows), grammars.tokenizer.vocab_size)
    llguidance.torch.fill_next_token_bitmask_par(
        grammars.executor, [(m, k) for k, (m, _) in enumerate(matchers)], words
    )
    bits = (words.unsqueeze(-1) >> _SHIFTS) & 1  # [rows, words, 32], token 32w + b
    allowed = bits.view(len(rows), -1).bool()
    if allowed.shape[1] < vocab:  # the model's padded vocabulary: never a real token
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    logits[rows] = logits[rows].masked_fill(~allowed[:, :vocab], float("-inf"))


_SHIFTS = torch.arange(32, dtype=torch.int32)
