"""The Ray Serve application of one base model: base weights once, adapters beside them.

Adapters load on demand from the artifact store through ``serve.multiplexed`` (so Serve
routes a request to a replica that already holds its adapter) and are evicted LRU.
Requests name their adapter in the header ``tunefleet.platform.serving`` names (the
TuneFleet API sets it after checking the caller may use that model); no header means the
bare base. Every request must carry the shared secret (``SECRET_HEADER``): Serve answers
the API, not whoever reaches its port.
OpenAI's ``/v1/chat/completions`` and ``/v1/completions``, whole or streamed as
server-sent events (``data: {...}`` chunks, then ``data: [DONE]``).

Glossary: *adapter id* is the job id that produced the adapter (its artifact key);
*model* is the name the client sent, echoed back in the response.
"""

# No `from __future__ import annotations` here: Serve's class-based ingress resolves the
# route signatures at run time and would take a string `Request` for a query parameter.
import asyncio
import hmac
import logging
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, Literal

import torch
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from transformers import AutoTokenizer

from tunefleet.platform.artifacts import cache_of, open_store
from tunefleet.platform.model_cache import local_model
from tunefleet.platform.node_cache import Pin
from tunefleet.platform.serving_contract import (
    ADAPTER_HEADER,
    ADAPTER_ID,
    SECRET_HEADER,
    adapter_weights_key,
    replica_label_selector,
)
from tunefleet.platform.settings import get_settings
from tunefleet.workers.serve._adapter_cache import AdapterCache, AdapterInUse, CacheFullError
from tunefleet.workers.serve._adapters import (
    AdapterError,
    load_serving_base,
    merge_into_copy,
    serving_precision,
)
from tunefleet.workers.serve._answer import Answer
from tunefleet.workers.serve._engine import BatchEngine
from tunefleet.workers.serve._generate import Sampling, eos_ids
from tunefleet.workers.serve._metrics import AdapterMetrics
from tunefleet.workers.serve._multilora import MultiLoraModel
from tunefleet.workers.serve._openai_api import (
    MAX_ROWS_PER_REQUEST,
    ChatRequest,
    CompletionRequest,
    GenerationRequest,
    Refused,
    error,
    parse,
    unservable,
)
from tunefleet.workers.serve._responses import Responses
from tunefleet.workers.serve._structured import GrammarError, Grammars

log = logging.getLogger("tunefleet.serve")

# How many adapter ids Serve's multiplexer remembers per replica, for routing only: it
# prefers a replica that reported an id. What is really loaded is the AdapterCache's
# business (max_adapters_per_replica, LRU, pinning).
MAX_ADAPTERS_PER_REPLICA = 1024


class ServingOptions(BaseModel):
    """Per-replica settings fixed at deployment (changing them restarts replicas)."""

    model_config = ConfigDict(extra="forbid")
    max_adapters_per_replica: int = Field(default=64, ge=1, le=MAX_ADAPTERS_PER_REPLICA)
    adapter_memory_bytes: int = Field(default=4 << 30, gt=0)  # the adapters' byte budget
    max_batch_size: int = Field(default=32, ge=1, le=1024)
    batch_wait_ms: float = Field(default=5.0, ge=0, le=1000)
    base_quantization: Literal["none", "nf4"] = "none"
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # settled by each replica at start


class ServingConfig(BaseModel):
    """Which adapters a replica serves merged, which it keeps pinned, which its node
    keeps copies of ahead of any request, and (read at start only) which it loads before
    it takes traffic: the most requested in the last hour."""

    model_config = ConfigDict(extra="forbid")
    merged: list[str] = Field(default_factory=list)
    pinned: list[str] = Field(default_factory=list)
    prefetch: list[str] = Field(default_factory=list)
    warm: list[str] = Field(default_factory=list)


app = FastAPI()


@app.exception_handler(Exception)
async def unexpected(_: Request, exc: Exception) -> JSONResponse:
    """A bug answers in OpenAI's shape too (the SDKs read ``error``), never as plain text."""
    log.exception("unhandled error")
    message = f"internal error in serving: {type(exc).__name__}"
    return error(500, message, "internal_error", param=None)


def not_an_adapter(adapter_id: str) -> JSONResponse:
    return error(400, f"{adapter_id[:80]!r} is not an adapter id (ftjob-...)", "invalid_adapter")


@app.middleware("http")
async def require_secret(request: Request, call_next: Any) -> Response:
    """The API's requests only: the shared secret (``LoraServer(secret=...)``, read from
    the replica itself: Serve runs a copy of this app), compared in constant time; a
    malformed adapter id is refused before anything loads."""
    expected: bytes | None = getattr(serve.get_replica_context().servable_object, "secret", None)
    given = request.headers.get(SECRET_HEADER)
    if given is None:
        message = f"missing {SECRET_HEADER}: Serve answers the TuneFleet API only"
        return error(401, message, "unauthorized", param=None)
    if expected is None or not hmac.compare_digest(given.encode(), expected):
        return error(403, f"wrong {SECRET_HEADER}", "forbidden", param=None)
    adapter_id = request.headers.get(ADAPTER_HEADER)
    if adapter_id and not ADAPTER_ID.fullmatch(adapter_id):
        return not_an_adapter(adapter_id)
    response: Response = await call_next(request)
    return response


@serve.deployment(
    # not on the head or a controller's node (no CPUs for work there, no models)
    ray_actor_options={"num_cpus": 0, "label_selector": replica_label_selector()},
    max_ongoing_requests=64,
)
@serve.ingress(app)
class LoraServer:
    """One replica: the base weights, the adapter cache, the batching engine, and a merged
    copy of the base per adapter served merged."""

    def __init__(
        self,
        base_model: str,
        model_path: str,
        store: dict[str, Any],
        options: dict[str, Any],
        secret: str,
    ):
        self.secret = secret.encode()
        self.base_model = base_model
        self.model_path = model_path
        self.options = ServingOptions.model_validate(options)
        # adapters come from the artifact store into this node's cache (its own settings say
        # where that is)
        self.store = open_store(**store, **cache_of(get_settings()))
        # the base model from this node's copy where there is a model cache, pinned while
        # the replica lives
        self.model_copy = local_model(model_path, get_settings())
        model_path = str(self.model_copy.path)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.metrics = AdapterMetrics()
        self.precision, why = serving_precision(self.options.precision)
        log.info("serving %s in %s (%s)", base_model, self.precision, why)
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float32
        base = load_serving_base(model_path, self.options.base_quantization, dtype)
        self.lora = MultiLoraModel(
            base,
            max_adapters=self.options.max_adapters_per_replica,
            budget_bytes=self.options.adapter_memory_bytes,
        )
        # a loaded adapter's files stay in the node's cache (pinned) until it is unloaded
        self._pins: dict[str, Pin] = {}
        self._pins_lock = threading.Lock()
        self.cache = AdapterCache(
            self.lora,
            locate=self._pinned_copy,
            on_load=self.metrics.loaded,
            on_evict=self.metrics.evicted,
            on_unload=self._unpin,
        )
        self.eos = eos_ids(base, self.tokenizer)
        self.grammars = Grammars(self.tokenizer, self.eos)
        self.responses = Responses(self.tokenizer, self.grammars)
        try:  # built now, not on the first structured or logprobs request
            self.grammars.tokenizer  # noqa: B018
        except GrammarError as exc:
            log.warning("%s", exc)
        # token ids a request may name: the tokenizer's (the model's rows may be padded)
        self.vocab = min(len(self.tokenizer), int(getattr(base.config, "vocab_size")))  # noqa: B009
        # prompt plus completion, in tokens: the positions the base was trained for
        self.context = int(getattr(base.config, "max_position_embeddings", 2048))
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else next(iter(self.eos), 0)
        self.engine = self._engine(self.lora)
        self.merged: dict[str, BatchEngine] = {}  # adapter id -> engine of its merged copy
        self.applied = ServingConfig()
        self._config_lock = threading.Lock()
        self._prefetched: set[str] = set()
        self._prefetching: threading.Thread | None = None
        self._uses: Counter[str] = Counter()  # requests per adapter since the last push
        self.warmed = self._warm_up()

    def _warm_up(self) -> list[str]:
        """Before this replica takes traffic (Serve routes none to it before its
        constructor returns): apply the serving configuration the controller last stored
        (``Keys.serving_key``: merged copies, pins, prefetch), load its ``warm`` adapters
        (the base model's most requested in the last hour) as many as the cache holds, and
        run one short generation. The first requests after a scale-up or a restart find
        the busiest adapters loaded and the kernels built. With no configuration stored
        yet, or storage away, it loads no adapter and the next push brings the rest."""
        key = self.store.serving_key(self.base_model)
        wanted = None
        try:
            wanted = ServingConfig.model_validate_json(b"".join(self.store.read_chunks(key)))
        except FileNotFoundError:
            pass
        except Exception as exc:  # storage away, a file from another version
            log.warning("warming no adapter: cannot read %s: %s", key, exc)
        warmed: list[str] = []
        slots = [0]
        if wanted is not None:
            self.apply_config(wanted)
            for adapter_id in wanted.warm[: self.cache.capacity]:
                try:
                    slots.append(self.cache.acquire(adapter_id, hold=False))
                except (AdapterError, CacheFullError, OSError) as exc:  # deleted meanwhile
                    log.warning("cannot warm adapter %s: %s", adapter_id, exc)
                    continue
                warmed.append(adapter_id)
            log.info("warmed %d of %d adapters", len(warmed), len(wanted.warm))
        self._warm_compute(slots[-1])
        if wanted is not None:
            self.prefetch(wanted.prefetch)
        return warmed

    def _warm_compute(self, slot: int) -> None:
        """One short greedy generation through the engine (with an adapter's ``slot``, so
        its layers' path runs too): a fresh model's first forward passes build kernels and
        buffers, hundreds of ms on a CPU, that the first request would wait for."""
        ended = threading.Event()

        def sink(token: int | None, finish: Any) -> None:
            if finish is not None:
                ended.set()

        prompt = list(self.tokenizer("Hello")["input_ids"]) or [self.pad_id]
        self.engine.submit(prompt, Sampling(max_tokens=4, temperature=0), slot, sink)
        if not ended.wait(300):
            log.warning("the warm-up generation did not end in 300 s")

    def _pinned_copy(self, adapter_id: str) -> Path:
        pin = self.store.pinned_copy(adapter_weights_key(adapter_id))
        with self._pins_lock:
            old, self._pins[adapter_id] = self._pins.get(adapter_id), pin
        if old is not None:
            old.release()
        return pin.path

    def _unpin(self, adapter_id: str) -> None:
        with self._pins_lock:
            pin = self._pins.pop(adapter_id, None)
        if pin is not None:
            pin.release()

    def _engine(self, lora: MultiLoraModel) -> BatchEngine:
        engine = BatchEngine(
            lora,
            self.eos,
            max_batch_size=self.options.max_batch_size,
            batch_wait_s=self.options.batch_wait_ms / 1000,
            pad_id=self.pad_id,
            grammars=self.grammars,
        )
        engine.start()
        return engine

    async def configure(self, config: dict[str, Any]) -> dict[str, Any]:
        """Called by the controller on every replica (``RayBackend.push_serving_config``)
        when the platform's serving configuration of this base model changes, and every
        few seconds so that a new replica learns it; answers what this replica applied,
        and the requests per adapter it answered since the last call (``uses``: what the
        controller ranks the adapters to warm by)."""
        wanted = ServingConfig.model_validate(config)
        if wanted.model_dump(exclude={"warm"}) != self.applied.model_dump(exclude={"warm"}):
            await asyncio.to_thread(self.apply_config, wanted)
        self.prefetch(wanted.prefetch)
        uses, self._uses = self._uses, Counter()
        return {**self.applied.model_dump(exclude={"warm"}), "uses": dict(uses)}

    def prefetch(self, adapter_ids: list[str]) -> None:
        """Copy ``adapter_ids`` from object storage into this node's cache in a background
        thread, newest first, so that a first request for one loads it from local disk
        (a cold load as fast as from the local store). One thread at a time: ids it did
        not reach come with the next push. Nothing to do with a local store."""
        missing = [a for a in adapter_ids if a not in self._prefetched]
        if not missing or (self._prefetching is not None and self._prefetching.is_alive()):
            return

        def copy_all() -> None:
            for adapter_id in missing:
                try:
                    self.store.local_copy(adapter_weights_key(adapter_id))
                except Exception as exc:  # deleted meanwhile, storage away: on request then
                    log.warning("cannot prefetch adapter %s: %s", adapter_id, exc)
                    continue
                self._prefetched.add(adapter_id)

        self._prefetching = threading.Thread(target=copy_all, name="prefetch", daemon=True)
        self._prefetching.start()

    async def prefetch_now(self, adapter_id: str) -> dict[str, Any]:
        """Copy one adapter to this node's cache now: the controller's call for a job that
        just succeeded, before it reads succeeded. What it did: ``copied``, and the bytes
        read from object storage (0: the node had it)."""
        before = getattr(self.store, "fetched", None)
        read = before.bytes if before is not None else 0
        try:
            await asyncio.to_thread(self.store.local_copy, adapter_weights_key(adapter_id))
        except Exception as exc:  # storage away, the node's disk full: on request then
            return {"copied": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
        self._prefetched.add(adapter_id)
        return {"copied": True, "bytes": (before.bytes - read) if before is not None else 0}

    def apply_config(self, wanted: ServingConfig) -> None:
        """Serve ``wanted.merged`` adapters merged and keep ``wanted.pinned`` loaded; requests
        already running finish where they started. The new merged engines are built
        aside and swapped in at the end, after the pins: whoever sees the new merged set
        (a request, the admin view) sees the new pins too."""
        with self._config_lock:
            for entry in self.cache.loaded():
                if entry["pinned"] and entry["id"] not in wanted.pinned:
                    self.cache.acquire(entry["id"], pin=False, hold=False)
            for adapter_id in wanted.pinned:
                try:
                    self.cache.acquire(adapter_id, pin=True, hold=False)
                except (AdapterError, CacheFullError, OSError) as exc:
                    log.error("cannot pin %s: %s", adapter_id, exc)
            kept = {a: e for a, e in self.merged.items() if a in wanted.merged}
            for adapter_id in set(wanted.merged) - set(kept):
                try:
                    folder = self.store.local_copy(adapter_weights_key(adapter_id))
                    merged = merge_into_copy(self.lora.base_copy(), folder)
                except Exception as exc:  # one bad adapter must not take the replica down
                    log.error("cannot serve %s merged: %s", adapter_id, exc)
                    continue
                kept[adapter_id] = self._engine(MultiLoraModel(merged, max_adapters=1))
            dropped = [e for a, e in self.merged.items() if a not in kept]
            self.applied = wanted
            self.merged = kept
            for engine in dropped:  # requests already on it finish first
                engine.stop()

    @serve.multiplexed(max_num_models_per_replica=MAX_ADAPTERS_PER_REPLICA)
    async def get_adapter(self, adapter_id: str) -> str:
        """Loads the adapter; through Serve's multiplexing this also tells the router that
        this replica holds it, so later requests for it come here."""
        await asyncio.to_thread(self.cache.acquire, adapter_id, hold=False)
        return adapter_id

    # -- adapter administration (this replica) -------------------------------------------
    @app.get("/v1/adapters")
    async def list_adapters(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": self.cache.loaded(),
            "merged": sorted(self.merged),
            "pinned": self.applied.pinned,
            "capacity": self.cache.capacity,
            "memory": self.cache.memory(),
            "running": len(self.engine.active),
        }

    @app.post("/v1/adapters/{adapter_id}/load")
    async def load_adapter(self, adapter_id: str, pin: bool = False) -> Any:
        if not ADAPTER_ID.fullmatch(adapter_id):
            return not_an_adapter(adapter_id)
        if not self.store.exists(adapter_weights_key(adapter_id)):
            return error(
                404, f"adapter {adapter_id!r} is not in the artifact store", "model_not_found"
            )
        try:
            await asyncio.to_thread(self.cache.acquire, adapter_id, pin=pin, hold=False)
        except AdapterError as exc:
            return unservable(adapter_id, exc)
        except CacheFullError as exc:
            return error(503, str(exc), "adapter_cache_full")
        return {"id": adapter_id, "loaded": True, "pinned": pin}

    @app.delete("/v1/adapters/{adapter_id}")
    async def unload_adapter(self, adapter_id: str) -> Any:
        if not ADAPTER_ID.fullmatch(adapter_id):
            return not_an_adapter(adapter_id)
        try:
            unloaded = await asyncio.to_thread(self.cache.unload, adapter_id)
        except AdapterInUse as exc:
            return error(409, str(exc), "adapter_in_use")
        return {"id": adapter_id, "unloaded": unloaded}

    # -- OpenAI endpoints ----------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Any:
        req = await parse(ChatRequest, request)
        if isinstance(req, JSONResponse):
            return req
        try:
            req.refuse_unsupported()
            req.check_tokens(self.vocab)
            messages = req.template_messages()
            grammar = None
            if req.response_format is not None:
                # the first one builds the grammar engine's view of the vocabulary
                grammar = await asyncio.to_thread(self.grammars.compile, req.response_format)
        except Refused as exc:
            return exc.response()
        except GrammarError as exc:
            return error(400, f"response_format: {exc}", "invalid_schema", "response_format")
        try:
            ids: Any = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=True
            )
        except Exception as exc:  # a template that refuses a role or its order (jinja)
            return error(
                400,
                f"the model's chat template refuses these messages: {exc}",
                "invalid_messages",
                "messages",
            )
        prompts = [list(ids["input_ids"])]
        asked = req.max_completion_tokens or req.max_tokens
        # no limit asked: as much as the context leaves, as OpenAI
        return await self._respond(req, prompts, asked, None, chat=True, grammar=grammar)

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Any:
        req = await parse(CompletionRequest, request)
        if isinstance(req, JSONResponse):
            return req
        prompts: list[list[int]] = []
        texts: list[str] = []
        try:
            req.refuse_unsupported()
            req.check_tokens(self.vocab)
            for i, given in enumerate(req.prompt_list()):
                if isinstance(given, str):
                    prompts.append(list(self.tokenizer(given)["input_ids"]))
                    texts.append(given)
                    continue
                wrong = [t for t in given if t >= self.vocab]
                if wrong:
                    raise Refused(
                        f"prompt {i}: token id {wrong[0]} is not in this model's vocabulary "
                        f"(ids 0 to {self.vocab - 1})",
                        "prompt",
                        code="invalid_value",
                    )
                prompts.append(given)
                texts.append(str(self.tokenizer.decode(given)))
        except Refused as exc:
            return exc.response()
        return await self._respond(req, prompts, req.max_tokens, 16, chat=False, texts=texts)

    def _refusal(
        self, req: GenerationRequest, prompts: list[list[int]], asked: int | None, chat: bool
    ) -> JSONResponse | None:
        """The 400 for a request this replica must not start (before any row is submitted,
        so nothing of it reaches the shared batch): too many rows, an empty prompt, or a
        prompt plus the asked completion over the model's context."""
        param = "messages" if chat else "prompt"
        rows = len(prompts) * req.choices_per_prompt
        if rows > MAX_ROWS_PER_REQUEST:
            return error(
                400,
                f"{len(prompts)} prompt(s) x {req.choices_per_prompt} choice(s) is {rows} "
                f"choices; at most {MAX_ROWS_PER_REQUEST} per request",
                "too_many_choices",
                param="n",
            )
        context = self.context
        for i, p in enumerate(prompts):
            where = "" if len(prompts) == 1 else f" {i}"
            if not p:
                return error(
                    400, f"prompt{where} is empty: give it some text", "empty_prompt", param=param
                )
            if len(p) + (asked or 1) > context:
                return error(
                    400,
                    f"This model's maximum context length is {context} tokens. However, you "
                    f"requested {len(p) + (asked or 1)} tokens ({len(p)} in the {param}{where}, "
                    f"{asked or 1} in the completion). Please reduce the length of the "
                    f"{param} or completion.",
                    "context_length_exceeded",
                    param=param,
                )
        return None

    async def _respond(
        self,
        req: GenerationRequest,
        prompts: list[list[int]],
        asked: int | None,
        default: int | None,
        *,
        chat: bool,
        grammar: str | None = None,
        texts: list[str] | None = None,
    ) -> Any:
        """``asked`` tokens at most (None: ``default``, within what the context leaves;
        no default: all it leaves). ``texts`` are a completion's prompts as text (echo,
        logprobs' offsets)."""
        refusal = self._refusal(req, prompts, asked, chat)
        if refusal is not None:
            return refusal
        room = self.context - max(len(p) for p in prompts)
        max_new = asked or min(default or room, room)
        adapter_id = serve.get_multiplexed_model_id()
        slot = 0
        merged = self.merged.get(adapter_id) if adapter_id else None
        engine = merged or self.engine
        if adapter_id:
            self._uses[adapter_id] += 1
        if adapter_id and merged is None:
            # asked of the store (a round trip to object storage) only when not loaded
            if adapter_id not in self.cache and not self.store.exists(
                adapter_weights_key(adapter_id)
            ):
                return error(
                    404, f"adapter {adapter_id!r} is not in the artifact store", "model_not_found"
                )
            try:
                await self.get_adapter(adapter_id)
                # held until the answer ends: the cache will not evict it meanwhile
                slot = await asyncio.to_thread(self.cache.acquire, adapter_id)
            except AdapterError as exc:
                return unservable(adapter_id, exc)
            except CacheFullError as exc:
                return error(503, str(exc), "adapter_cache_full")
        # one row per prompt and candidate: index = prompt * n + sample, as OpenAI numbers
        # them (best_of decodes more candidates per prompt and keeps the n likeliest)
        per = req.choices_per_prompt
        rows = [(p, req.sampling(max_new, k, grammar)) for p in prompts for k in range(per)]
        answer = Answer(self, engine, slot, adapter_id, rows)
        head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "created": int(time.time()),
            "model": req.model,
            "system_fingerprint": None,
        }
        if req.stream:
            events = self.responses.events(req, answer, head, texts, chat=chat)
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            async for _ in answer:
                pass
        except Exception as exc:  # the batch failed: said in OpenAI's shape, not as text
            log.exception("a batch failed")
            return error(500, f"generation failed: {exc}", "server_error", param=None)
        return JSONResponse(self.responses.whole(req, head, answer.done, prompts, texts, chat=chat))

    @app.get("/healthz")
    async def healthz(self) -> dict[str, str]:
        return {"status": "ok", "base_model": self.base_model, "precision": self.precision}


def weights_bytes(model_path: str) -> int:
    """What a replica reserves for its base model's weights: their safetensors' size."""
    return sum(f.stat().st_size for f in Path(model_path).glob("*.safetensors"))


def build_app(
    *,
    base_model: str,
    model_path: str,
    store: dict[str, str],
    secret: str,
    options: ServingOptions | None = None,
    min_replicas: int = 1,
    max_replicas: int = 1,
    target_ongoing_requests: float = 16,
) -> Any:
    """The application of one base model. With ``max_replicas > min_replicas`` Serve
    autoscales on ongoing requests per replica."""
    deployment: Any = LoraServer  # the @serve.deployment wrapper, untyped
    scaling: dict[str, Any] = (
        {
            "autoscaling_config": {
                "min_replicas": min_replicas,
                "max_replicas": max_replicas,
                "target_ongoing_requests": target_ongoing_requests,
            }
        }
        if max_replicas > min_replicas
        else {"num_replicas": min_replicas}
    )
    # A replica reserves the memory its base weights and its adapters' budget take: Ray
    # places it only where both fit beside the node's other replicas (of other base models
    # too), its autoscaler adds a node for one that fits nowhere, and a node holding
    # replicas is never idle, so it does not remove it (and its adapters) as unused.
    options = options or ServingOptions()
    memory = weights_bytes(model_path) + options.adapter_memory_bytes
    actor = {**deployment.ray_actor_options, "memory": memory}
    return deployment.options(name="LoraServer", ray_actor_options=actor, **scaling).bind(
        base_model, model_path, store, options.model_dump(), secret
    )
