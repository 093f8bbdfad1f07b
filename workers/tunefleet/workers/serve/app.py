"""The Ray Serve application of one base model: base weights once, adapters beside them.

Adapters load on demand from the artifact store through ``serve.multiplexed`` (so Serve
routes a request to a replica that already holds its adapter) and are evicted LRU.
Requests name their adapter with the ``serve_multiplexed_model_id`` header (the TuneFleet
API sets it after checking the caller may use that model); no header means the bare base.

Glossary: *adapter id* is the job id that produced the adapter (its artifact key);
*model* is the name the client sent, echoed back in the response.
"""

# No `from __future__ import annotations` here: Serve's class-based ingress resolves the
# route signatures at run time and would take a string `Request` for a query parameter.
import asyncio
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from transformers import AutoModelForCausalLM, AutoTokenizer

from tunefleet.platform.artifacts import ArtifactStore

BASE = "__base__"  # peft's name for "no adapter" in a mixed batch
MAX_ADAPTERS_PER_REPLICA = 64


def route_prefix(base_model: str) -> str:
    return f"/models/{base_model}"


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | None = None


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=4096)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=4096)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None


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

    @serve.multiplexed(max_num_models_per_replica=MAX_ADAPTERS_PER_REPLICA)
    async def get_adapter(self, adapter_id: str) -> _LoadedAdapter:
        path = self.store.path(self.store.adapter_key(adapter_id))
        await asyncio.to_thread(self._attach, adapter_id, path)
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

    def _generate(self, req: ChatRequest, adapter_id: str) -> dict[str, Any]:
        messages = [{"role": m.role, "content": m.content or ""} for m in req.messages]
        enc: Any = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        max_new = req.max_completion_tokens or req.max_tokens or 256
        greedy = req.temperature == 0
        if req.seed is not None:
            torch.manual_seed(req.seed)
        kwargs: dict[str, Any] = {
            "max_new_tokens": max_new,
            "do_sample": not greedy,
            "pad_token_id": self.tokenizer.pad_token_id or self.tokenizer.eos_token_id,
        }
        if not greedy:
            kwargs.update(temperature=req.temperature, top_p=req.top_p)
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        with self._lock, torch.inference_mode():
            if hasattr(self.model, "peft_config"):
                kwargs["adapter_names"] = [adapter_id or BASE]
            out = self.model.generate(**enc, **kwargs)
        new_ids = out[0, enc["input_ids"].shape[1] :]
        text = self.tokenizer.decode(new_ids, skip_special_tokens=True)
        finish = "length" if len(new_ids) >= max_new else "stop"
        for stop in stops:
            if stop and stop in text:
                text, finish = text[: text.index(stop)], "stop"
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": req.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": finish,
                    "logprobs": None,
                }
            ],
            "usage": {
                "prompt_tokens": int(enc["input_ids"].shape[1]),
                "completion_tokens": len(new_ids),
                "total_tokens": int(enc["input_ids"].shape[1]) + len(new_ids),
            },
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> JSONResponse:
        req = ChatRequest.model_validate(await request.json())
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
        return JSONResponse(await asyncio.to_thread(self._generate, req, adapter_id))

    @app.get("/healthz")
    async def healthz(self) -> dict[str, str]:
        return {"status": "ok", "base_model": self.base_model}


def build_app(*, base_model: str, model_path: str, artifact_root: str) -> Any:
    deployment: Any = LoraServer  # the @serve.deployment wrapper, untyped
    return deployment.options(name="LoraServer").bind(base_model, model_path, artifact_root)
