"""OpenAI's chat and completion requests as a replica reads them, with the bounds on what
one request may cost it, the parameters it refuses (400, naming them: nothing is silently
ignored), and its errors in OpenAI's shape (the answers are ``responses.py``'s).

docs/api.md has the compatibility table: every parameter is supported, refused, or
accepted as not applicable (``user``, ``metadata``, ``service_tier``... have nothing to
act on in a self-hosted server).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar, cast

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tunefleet.workers.serve._adapters import AdapterError
from tunefleet.workers.serve._generate import Sampling

# Bounds on what one request may cost a replica (every other tenant's rows share its batch).
MAX_ROWS_PER_REQUEST = 128  # prompts x n (OpenAI's n is at most 128)
MAX_MESSAGES = 2048
MAX_STOP = 4  # as OpenAI
MAX_STOP_CHARS = 256
MAX_LOGIT_BIAS = 300  # as OpenAI


class Refused(Exception):
    """A valid request this server will not answer, or a value only the replica can check
    (a token id against its vocabulary): a 400 that names the parameter and the fix."""

    def __init__(self, message: str, param: str | None, code: str = "unsupported_parameter"):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code

    def response(self) -> JSONResponse:
        return error(400, self.message, self.code, param=self.param)


class _Body(BaseModel):
    """OpenAI refuses an argument it does not know ("Unrecognized request argument"); so
    do we. ``null`` means "the default" for every field, as in OpenAI's API."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


TEXT_PARTS = {"text", "refusal"}


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None  # accepted: the chat template has no place for it
    refusal: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    function_call: Any = None
    audio: Any = None

    def for_template(self, index: int) -> dict[str, str]:
        """The message as the chat template takes it; text parts are joined, other parts
        and tool messages refused."""
        where = f"messages[{index}]"
        if self.role in ("tool", "function") or self.tool_calls or self.function_call:
            raise Refused(
                f"{where}: tool messages and tool calls are not supported (this server does "
                "not call tools); for structured answers use response_format json_schema",
                f"{where}.role",
            )
        if self.audio is not None:
            raise Refused(f"{where}.audio: audio is not supported", f"{where}.audio")
        content = self.content
        if isinstance(content, list):
            texts = []
            for k, part in enumerate(content):
                kind = part.get("type")
                if not isinstance(kind, str) or kind not in TEXT_PARTS:
                    raise Refused(
                        f"{where}.content[{k}]: content part type {str(kind)[:40]!r} is not "
                        "supported: the model reads text only; send parts of type 'text' "
                        '({"type": "text", "text": "..."}) or a string',
                        f"{where}.content",
                        code="unsupported_content_type",
                    )
                if not isinstance(part.get(kind), str):
                    raise Refused(
                        f"{where}.content[{k}]: a {kind!r} part needs its {kind!r} string",
                        f"{where}.content",
                        code="invalid_value",
                    )
                texts.append(part[kind])
            content = "\n".join(texts)
        role = "system" if self.role == "developer" else self.role  # templates know system
        return {"role": role, "content": content or self.refusal or ""}


class StreamOptions(_Body):
    include_usage: bool = False
    include_obfuscation: bool = False  # accepted: no obfuscation padding is sent


StopField = (
    Annotated[str, Field(max_length=MAX_STOP_CHARS)]
    | Annotated[list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]], Field(max_length=MAX_STOP)]
    | None
)


class GenerationRequest(_Body):
    model: str
    # no bound of its own: the model's context bounds prompt + completion (400 beyond)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, ge=0, le=1)  # 0: the likeliest token only
    n: int = Field(default=1, ge=1, le=MAX_ROWS_PER_REQUEST)
    # torch seeds a generator with a 64-bit integer; each of n choices adds its index
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: StopField = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    logit_bias: (
        Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]], Field(max_length=300)] | None
    ) = None
    user: str | None = Field(default=None, max_length=256)  # not applicable: no abuse team

    def top_logprobs_asked(self) -> int | None:
        """None: no log-probabilities; k: the sampled token's and the k likeliest."""
        return None

    @property
    def choices_per_prompt(self) -> int:
        return self.n

    def sampling(self, max_tokens: int, choice: int, grammar: str | None = None) -> Sampling:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return Sampling(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            # each of n choices draws its own sample, reproducibly when seeded
            seed=None if self.seed is None else self.seed + choice,
            stop=tuple(s for s in stops if s),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=tuple((int(t), b) for t, b in (self.logit_bias or {}).items()),
            logprobs=self.top_logprobs_asked(),
            grammar=grammar,
        )

    def check_tokens(self, vocab: int) -> None:
        """Token ids the request names exist in the model's vocabulary."""
        for key in self.logit_bias or {}:
            if not (key.isascii() and key.isdigit()) or int(key) >= vocab:
                raise Refused(
                    f"logit_bias key {key[:40]!r} is not a token id of this model: keys are "
                    f"token ids from 0 to {vocab - 1}",
                    "logit_bias",
                    code="invalid_value",
                )


class ChatRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    # refused below: this server calls no tools and makes no audio
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[Literal["text", "audio"]] | None = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: Any = None
    # not applicable: accepted, with nothing to act on (docs/api.md)
    store: bool = False
    metadata: dict[str, str] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    moderation: Any = None  # refused below: no moderation model runs here
    prompt_cache_key: str | None = Field(default=None, max_length=1024)
    safety_identifier: str | None = Field(default=None, max_length=256)

    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def refuse_unsupported(self) -> None:
        """400 for what a text model without tools cannot honour, rather than an answer
        that silently ignores it."""
        if self.tools or self.functions:
            param = "tools" if self.tools else "functions"
            raise Refused(
                f"{param}: tool calling is not supported by TuneFleet's serving; for a JSON "
                "answer of a given shape use response_format "
                '{"type": "json_schema", "json_schema": {...}}',
                param,
            )
        if self.tool_choice not in (None, "none"):
            raise Refused("tool_choice is only allowed when tools are given", "tool_choice")
        if self.function_call not in (None, "none"):
            raise Refused("function_call is only allowed when functions are given", "function_call")
        if self.audio is not None or "audio" in (self.modalities or []):
            raise Refused("audio output is not supported: the model writes text", "modalities")
        for name in (
            "prediction",
            "reasoning_effort",
            "verbosity",
            "web_search_options",
            "moderation",
        ):
            if getattr(self, name) is not None:
                raise Refused(f"{name} is not supported by this model", name)
        if self.store:
            raise Refused("store: stored completions are not supported; leave store false", "store")
        if self.top_logprobs is not None and not self.logprobs:
            raise Refused("top_logprobs needs logprobs: true", "top_logprobs")

    def template_messages(self) -> list[dict[str, str]]:
        return [m.for_template(i) for i, m in enumerate(self.messages)]


PromptField = (
    Annotated[str, Field()]
    | Annotated[list[str], Field(min_length=1, max_length=MAX_ROWS_PER_REQUEST)]
    | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    | Annotated[
        list[Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]],
        Field(min_length=1, max_length=MAX_ROWS_PER_REQUEST),
    ]
)


class CompletionRequest(GenerationRequest):
    prompt: PromptField
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1, le=MAX_ROWS_PER_REQUEST)
    suffix: str | None = None

    def top_logprobs_asked(self) -> int | None:
        if self.logprobs is None and self.choices_per_prompt > self.n:
            return 0  # best_of ranks its candidates by their tokens' log-probabilities
        return self.logprobs

    @property
    def choices_per_prompt(self) -> int:
        """Candidates decoded per prompt: ``best_of`` of them, the ``n`` likeliest kept."""
        return max(self.n, self.best_of or 1)

    def refuse_unsupported(self) -> None:
        if self.best_of is not None and self.best_of < self.n:
            raise Refused(f"best_of ({self.best_of}) must be at least n ({self.n})", "best_of")
        if self.best_of and self.best_of > self.n and self.stream:
            raise Refused("best_of cannot be used with stream: true", "best_of")
        if self.suffix:
            raise Refused(
                "suffix: inserting text before a suffix is not supported; send the whole prompt",
                "suffix",
            )
        if self.echo and self.logprobs is not None:
            raise Refused(
                "echo with logprobs is not supported (the prompt's log-probabilities are "
                "not computed); ask for one of them",
                "echo",
            )

    def prompt_list(self) -> list[str | list[int]]:
        """The prompts, as texts or as token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [[int(t) for t in p]]
        return list(cast(list[str | list[int]], p))


_Parsed = TypeVar("_Parsed", bound=BaseModel)


def unservable(adapter_id: str, exc: AdapterError) -> JSONResponse:
    """400: an adapter batched serving cannot apply exactly (DoRA, trained biases, another
    base's shapes, more than the replica's adapter memory...): the request is fine, the
    adapter needs the merged mode."""
    return error(
        400,
        f"adapter {adapter_id!r} cannot be served batched: {exc}; an admin can serve it merged "
        "(PATCH /v1/admin/adapters/{model} with serving_mode 'merged')",
        exc.code,
    )


def error(status: int, message: str, code: str, param: str | None = "model") -> JSONResponse:
    return JSONResponse(
        status_code=status,
        content={
            "error": {
                "message": message,
                "type": "invalid_request_error" if status < 500 else "server_error",
                "param": param,
                "code": code,
            }
        },
    )


async def parse(model: type[_Parsed], request: Request) -> _Parsed | JSONResponse:
    """The request body as ``model``, or the 400 that names what is wrong with it."""
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        errors = exc.errors()
        first = errors[0] if errors else {"loc": ()}
        loc = first.get("loc", ())
        param = str(loc[0]) if loc else None  # the request's field (pydantic adds union tags)
        detail = "; ".join(_described(e) for e in errors[:5])
        code = "unrecognized_argument" if first.get("type") == "extra_forbidden" else None
        return error(400, f"invalid request: {detail}", code or "invalid_request", param=param)


def _described(e: Any) -> str:
    where = ".".join(str(p) for p in e.get("loc", ()))
    if e.get("type") == "extra_forbidden":
        return f"unrecognized request argument supplied: {where}"
    return f"{where}: {e.get('msg')}"
