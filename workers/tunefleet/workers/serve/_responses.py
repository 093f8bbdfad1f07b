"""A request's answer in OpenAI's shape: whole, from its finished rows, or as the
server-sent events of its rows as they decode (``data: {chunk}``, then ``data: [DONE]``);
its choices, their logprobs (tokens named and placed in the text), and its usage."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from tunefleet.workers.serve._answer import Answer
from tunefleet.workers.serve._generate import Finished, TokenLogprob
from tunefleet.workers.serve._openai_api import CompletionRequest, GenerationRequest
from tunefleet.workers.serve._structured import Grammars


class Responses:
    """How one replica writes its answers: its tokenizer places tokens in the text, the
    grammar engine's view of the vocabulary names them (``Grammars.token_text``)."""

    def __init__(self, tokenizer: Any, grammars: Grammars):
        self.tokenizer = tokenizer
        self.grammars = grammars

    def whole(
        self,
        req: GenerationRequest,
        head: dict[str, Any],
        done: list[Finished],
        prompts: list[list[int]],
        texts: list[str] | None,
        *,
        chat: bool,
    ) -> dict[str, Any]:
        """The answer of a request whose ``done`` rows (``choices_per_prompt`` for each of
        ``prompts``, in order) all ended; ``texts`` are a completion's prompts as text."""
        per = req.choices_per_prompt
        # best_of: the n candidates of each prompt with the highest logprob per token
        kept = [
            i
            for start in range(0, len(done), per)
            for i in sorted(range(start, start + per), key=lambda i: -_mean_logprob(done[i]))[
                : req.n
            ]
        ]
        choices = [
            self._choice(req, j, done[i], texts[i // per] if texts else "", chat=chat)
            for j, i in enumerate(kept if per > req.n else range(len(done)))
        ]
        return {
            **head,
            "object": "chat.completion" if chat else "text_completion",
            "choices": choices,
            "usage": usage(done, prompts),
        }

    def _choice(
        self, req: GenerationRequest, index: int, f: Finished, prompt: str, *, chat: bool
    ) -> dict[str, Any]:
        if chat:
            return {
                "index": index,
                "message": {"role": "assistant", "content": f.text, "refusal": None},
                "logprobs": self.chat_logprobs(f.logprobs),
                "finish_reason": f.finish_reason,
            }
        assert isinstance(req, CompletionRequest)
        logprobs = f.logprobs if req.logprobs is not None else None
        starts = self.offsets(len(prompt), f.token_ids, 0, len(logprobs or []))
        return {
            "index": index,
            "text": (prompt if req.echo else "") + f.text,
            "logprobs": self.completion_logprobs(logprobs, starts),
            "finish_reason": f.finish_reason,
        }

    async def events(
        self,
        req: GenerationRequest,
        answer: Answer,
        head: dict[str, Any],
        texts: list[str] | None,
        *,
        chat: bool,
    ) -> AsyncIterator[str]:
        """Server-sent events: each choice's deltas as the batch makes them, with their
        tokens' logprobs when asked; an error after the headers went is a last event."""
        with_usage = req.stream_options is not None and req.stream_options.include_usage
        obj = "chat.completion.chunk" if chat else "text_completion"
        prompt_chars = [len(texts[i // req.n]) if texts else 0 for i in range(len(answer.choices))]
        tokens: list[list[int]] = [[] for _ in answer.choices]  # each choice's, so far

        def event(choices: list[dict[str, Any]], **extra: Any) -> str:
            chunk = {**head, "object": obj, "choices": choices, **extra}
            if with_usage and "usage" not in extra:
                chunk["usage"] = None
            return f"data: {json.dumps(chunk)}\n\n"

        def choice(
            i: int, delta: str | None, logprobs: list[TokenLogprob] | None, finish: str | None
        ) -> dict[str, Any]:
            if chat:
                body: dict[str, Any] = {"delta": {} if delta is None else {"content": delta}}
                shown = self.chat_logprobs(logprobs)
            else:
                body = {"text": delta or ""}
                first = len(tokens[i])
                tokens[i] += [t.token for t in logprobs or []]
                starts = self.offsets(prompt_chars[i], tokens[i], first, len(tokens[i]) - first)
                shown = self.completion_logprobs(logprobs, starts)
            return {"index": i, **body, "logprobs": shown, "finish_reason": finish}

        for i in range(len(answer.choices)):
            if chat:
                first = {"index": i, "delta": {"role": "assistant", "content": ""}}
                yield event([{**first, "logprobs": None, "finish_reason": None}])
            elif texts and isinstance(req, CompletionRequest) and req.echo:
                yield event([choice(i, texts[i // req.n], None, None)])
        try:
            async for i, delta, logprobs, finished in answer:
                if delta or logprobs:
                    yield event([choice(i, delta, logprobs, None)])
                if finished is not None:
                    yield event([choice(i, None, None, finished.finish_reason)])
        except Exception as exc:  # headers are sent: report in the stream, as OpenAI does
            failure = {"message": str(exc), "type": "server_error", "param": None, "code": None}
            yield f"data: {json.dumps({'error': failure})}\n\n"
            return
        if with_usage:
            yield event([], usage=usage(answer.done, [p for p, _ in answer.choices[:: req.n]]))
        yield "data: [DONE]\n\n"

    def offsets(self, start: int, ids: list[int], first: int, count: int) -> list[int]:
        """Where tokens ``first`` to ``first + count`` of ``ids`` begin in the text (a token
        can hold part of a character: offsets come from decoding the prefixes)."""
        decode = self.tokenizer.decode
        return [
            start + len(decode(ids[:k], skip_special_tokens=True))
            for k in range(first, first + count)
        ]

    def chat_logprobs(self, entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
        """``choices[].logprobs`` of a chat completion: ``content``, one entry per token."""
        if entries is None:
            return None
        named = self.grammars

        def one(token: int, logprob: float) -> dict[str, Any]:
            return {
                "token": named.token_text(token),
                "logprob": logprob,
                "bytes": list(named.token_bytes(token)),
            }

        content = [
            {**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
            for e in entries
        ]
        return {"content": content, "refusal": None}

    def completion_logprobs(
        self, entries: list[TokenLogprob] | None, offsets: list[int]
    ) -> dict[str, Any] | None:
        """``choices[].logprobs`` of a legacy completion: tokens, their logprobs, the top
        ones by token text, and where each token begins in prompt + completion."""
        if entries is None:
            return None
        name = self.grammars.token_text
        return {
            "tokens": [name(e.token) for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{name(t): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets[: len(entries)],
        }


def usage(done: list[Finished], prompts: list[list[int]]) -> dict[str, Any]:
    """Every row's tokens count, the candidates best_of did not keep included (as OpenAI
    bills them)."""
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(f.completion_tokens for f in done)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _mean_logprob(f: Finished) -> float:
    """best_of's ranking: a candidate's log-probability per token, as OpenAI's."""
    return sum(t.logprob for t in f.logprobs or []) / max(1, len(f.logprobs or []))
