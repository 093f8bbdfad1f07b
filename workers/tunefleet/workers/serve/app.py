"""The Ray Serve application of one base model: base weights once, adapters beside them.

Adapters load on demand from the artifact store through ``serve.multiplexed`` (so Serve
routes a request to a replica that already holds its adapter) and are evicted LRU.
Requests name their adapter with the ``serve_multiplexed_model_id`` header (the TuneFleet
API sets it after checking the caller may use that model); no header means the bare base.
OpenAI's ``/v1/chat/completions`` and ``/v1/completions``, whole or streamed as
server-sent events (``data: {...}`` chunks, then ``data: [DONE]``).

Glossary: *adapter id* is the job id that produced the adapter (its artifact key);
*model* is the name the client sent, echoed back in the response.
"""

# No `from __future__ import annotations` here: Serve's class-based ingress resolves the
# route signatures at run time and would take a string `Request` for a query parameter.
import asyncio
import json
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from transformers import AutoModelForCausalLM, AutoTokenizer

from tunefleet.platform.artifacts import ArtifactStore
from tunefleet.workers.serve.generate import Finished, Sampling, complete, decode

MAX_ADAPTERS_PER_REPLICA = 64


def route_prefix(base_model: str) -> str:
    return f"/models/{base_model}"


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class _GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: int | None = Field(default=None, ge=1, le=4096)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=16)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None

    def sampling(self, max_tokens: int, choice: int) -> Sampling:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return Sampling(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            # each of n choices draws its own sample, reproducibly when seeded
            seed=None if self.seed is None else self.seed + choice,
            stop=tuple(s for s in stops[:4] if s),
        )


class ChatRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=4096)


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str]


# Module-level helpers the deployment uses sit above it: Serve's class-based ingress
# serializes the class when it is decorated, with the globals defined by then.
def _usage(done: list[Finished], prompts: list[list[int]]) -> dict[str, int]:
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(f.completion_tokens for f in done)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class _LoadedAdapter:
    """Handle Serve's multiplexer keeps per adapter; eviction unloads it from the model."""

    def __init__(self, server: "LoraServer", adapter_id: str):
        self.server, self.adapter_id, self._live = server, adapter_id, True

    def __del__(self) -> None:
        if getattr(self, "_live", False):
            self._live = False
            self.server.unload(self.adapter_id)


app = FastAPI()


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=32)
@serve.ingress(app)
class LoraServer:
    def __init__(self, base_model: str, model_path: str, artifact_root: str):
        self.base_model = base_model
        self.store = ArtifactStore(Path(artifact_root))
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model: Any = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.model.eval()
        self._lock = threading.Lock()  # generate and load/unload change shared modules
        # Per-adapter metrics through Ray's metrics agent (Prometheus on each node's
        # metrics export port); Serve adds the deployment, replica and application tags.
        from ray.serve import metrics

        per_adapter = ("adapter",)
        self.m_requests = metrics.Counter(
            "tunefleet_adapter_requests", "Requests per adapter.", tag_keys=per_adapter
        )
        self.m_tokens = metrics.Counter(
            "tunefleet_adapter_generated_tokens", "Tokens generated.", tag_keys=per_adapter
        )
        self.m_latency = metrics.Histogram(
            "tunefleet_adapter_request_seconds",
            "Time from request to last token.",
            boundaries=[0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60],
            tag_keys=per_adapter,
        )
        self.m_loads = metrics.Counter(
            "tunefleet_adapter_loads", "Adapters loaded into this replica.", tag_keys=per_adapter
        )
        self.m_evictions = metrics.Counter(
            "tunefleet_adapter_evictions", "Adapters evicted (LRU).", tag_keys=per_adapter
        )

    @serve.multiplexed(max_num_models_per_replica=MAX_ADAPTERS_PER_REPLICA)
    async def get_adapter(self, adapter_id: str) -> _LoadedAdapter:
        path = self.store.path(self.store.adapter_key(adapter_id))
        await asyncio.to_thread(self._attach, adapter_id, path)
        self.m_loads.inc(tags={"adapter": adapter_id})
        return _LoadedAdapter(self, adapter_id)

    def _attach(self, adapter_id: str, path: Path) -> None:
        from peft import PeftModel

        with self._lock:
            if isinstance(self.model, PeftModel):
                self.model.load_adapter(str(path), adapter_name=adapter_id)
            else:
                self.model = PeftModel.from_pretrained(
                    self.model, str(path), adapter_name=adapter_id
                )
            self.model.eval()

    def unload(self, adapter_id: str) -> None:
        with self._lock:
            if adapter_id in getattr(self.model, "peft_config", {}):
                self.model.delete_adapter(adapter_id)
                self.m_evictions.inc(tags={"adapter": adapter_id})

    # -- OpenAI endpoints ----------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Any:
        req = ChatRequest.model_validate(await request.json())
        messages = [{"role": m.role, "content": m.content or ""} for m in req.messages]
        ids: Any = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )
        prompts = [list(ids["input_ids"])]
        max_new = req.max_completion_tokens or req.max_tokens or 256
        return await self._respond(req, prompts, max_new, chat=True)

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Any:
        req = CompletionRequest.model_validate(await request.json())
        texts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        prompts = [list(self.tokenizer(t)["input_ids"]) for t in texts]
        return await self._respond(req, prompts, req.max_tokens or 16, chat=False)

    async def _respond(
        self, req: _GenerationRequest, prompts: list[list[int]], max_new: int, *, chat: bool
    ) -> Any:
        adapter_id = serve.get_multiplexed_model_id()
        if adapter_id:
            if not self.store.exists(self.store.adapter_key(adapter_id)):
                return JSONResponse(
                    status_code=404,
                    content={
                        "error": {
                            "message": f"adapter {adapter_id!r} is not in the artifact store",
                            "type": "invalid_request_error",
                            "param": "model",
                            "code": "model_not_found",
                        }
                    },
                )
            await self.get_adapter(adapter_id)
        # one choice per prompt and sample: index = prompt * n + sample, as OpenAI numbers them
        started = time.perf_counter()
        jobs = [(p, req.sampling(max_new, k)) for p in prompts for k in range(req.n)]
        head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "created": int(time.time()),
            "model": req.model,
        }
        if req.stream:
            events = self._stream(req, jobs, adapter_id, head, started, chat=chat)
            return StreamingResponse(events, media_type="text/event-stream")
        done = await asyncio.to_thread(
            lambda: [
                complete(self.model, self.tokenizer, p, s, adapter_id=adapter_id, lock=self._lock)
                for p, s in jobs
            ]
        )
        self._record(adapter_id, done, started)
        choices = [
            {"index": i, "message": {"role": "assistant", "content": f.text}}
            if chat
            else {"index": i, "text": f.text}
            for i, f in enumerate(done)
        ]
        for choice, f in zip(choices, done, strict=True):
            choice.update(finish_reason=f.finish_reason, logprobs=None)
        return JSONResponse(
            {
                **head,
                "object": "chat.completion" if chat else "text_completion",
                "choices": choices,
                "usage": _usage(done, prompts),
            }
        )

    def _record(self, adapter_id: str, done: list[Finished], started: float) -> None:
        tags = {"adapter": adapter_id or "base"}
        self.m_requests.inc(tags=tags)
        tokens = sum(f.completion_tokens for f in done)
        if tokens:
            self.m_tokens.inc(tokens, tags=tags)
        self.m_latency.observe(time.perf_counter() - started, tags=tags)

    def _stream(
        self,
        req: _GenerationRequest,
        jobs: list[tuple[list[int], Sampling]],
        adapter_id: str,
        head: dict[str, Any],
        started: float,
        *,
        chat: bool,
    ) -> Iterator[str]:
        """Server-sent events; Starlette runs this generator in its thread pool."""
        usage = req.stream_options is not None and req.stream_options.include_usage
        obj = "chat.completion.chunk" if chat else "text_completion"

        def event(choices: list[dict[str, Any]], **extra: Any) -> str:
            chunk = {**head, "object": obj, "choices": choices, **extra}
            if usage and "usage" not in extra:
                chunk["usage"] = None
            return f"data: {json.dumps(chunk)}\n\n"

        def choice(i: int, delta: str | None, finish: str | None) -> dict[str, Any]:
            if chat:
                body: dict[str, Any] = {"delta": {} if delta is None else {"content": delta}}
            else:
                body = {"text": delta or ""}
            return {"index": i, **body, "logprobs": None, "finish_reason": finish}

        done: list[Finished] = []
        for i, (prompt, sampling) in enumerate(jobs):
            if chat:
                first = {"index": i, "delta": {"role": "assistant", "content": ""}}
                yield event([{**first, "logprobs": None, "finish_reason": None}])
            for item in decode(
                self.model,
                self.tokenizer,
                prompt,
                sampling,
                adapter_id=adapter_id,
                lock=self._lock,
            ):
                if isinstance(item, Finished):
                    done.append(item)
                    yield event([choice(i, None, item.finish_reason)])
                else:
                    yield event([choice(i, item, None)])
        self._record(adapter_id, done, started)
        if usage:
            yield event([], usage=_usage(done, [p for p, _ in jobs[:: req.n]]))
        yield "data: [DONE]\n\n"

    @app.get("/healthz")
    async def healthz(self) -> dict[str, str]:
        return {"status": "ok", "base_model": self.base_model}


def build_app(*, base_model: str, model_path: str, artifact_root: str) -> Any:
    deployment: Any = LoraServer  # the @serve.deployment wrapper, untyped
    return deployment.options(name="LoraServer").bind(base_model, model_path, artifact_root)
