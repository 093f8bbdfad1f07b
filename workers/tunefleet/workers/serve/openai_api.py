"""OpenAI's chat and completion requests as a replica reads them, with the bounds on what
one request may cost it, and the errors it answers in OpenAI's shape."""

from __future__ import annotations

from typing import Annotated, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tunefleet.workers.serve.adapters import AdapterError
from tunefleet.workers.serve.generate import Finished, Sampling


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


# Bounds on what one request may cost a replica (every other tenant's rows share its batch).
MAX_ROWS_PER_REQUEST = 64  # prompts x n
MAX_MESSAGES = 2048
MAX_STOP = 4  # as OpenAI
MAX_STOP_CHARS = 256


class GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    model: str
    max_tokens: int | None = Field(default=None, ge=1, le=4096)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=16)
    # torch seeds a generator with a 64-bit integer; each of n choices adds its index
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: (
        Annotated[str, Field(max_length=MAX_STOP_CHARS)]
        | Annotated[
            list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]], Field(max_length=MAX_STOP)
        ]
        | None
    ) = None
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


class ChatRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=4096)


class CompletionRequest(GenerationRequest):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=MAX_ROWS_PER_REQUEST)]


_Body = TypeVar("_Body", bound=BaseModel)


def usage(done: list[Finished], prompts: list[list[int]]) -> dict[str, int]:
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(f.completion_tokens for f in done)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def unservable(adapter_id: str, exc: AdapterError) -> JSONResponse:
    """400: an adapter batched serving cannot apply exactly (DoRA, trained biases, another
    base's shapes...): the request is fine, the adapter needs the merged mode."""
    return error(
        400,
        f"adapter {adapter_id!r} cannot be served batched: {exc}; an admin can serve it merged "
        "(PATCH /v1/admin/adapters/{model} with serving_mode 'merged')",
        "adapter_unservable",
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


async def parse(model: type[_Body], request: Request) -> _Body | JSONResponse:
    """The request body as ``model``, or the 400 that names what is wrong with it."""
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        errors = exc.errors()
        first = errors[0] if errors else {"loc": ()}
        loc = first.get("loc", ())
        param = str(loc[0]) if loc else None  # the request's field (pydantic adds union tags)
        detail = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in errors[:5]
        )
        return error(400, f"invalid request: {detail}", "invalid_request", param=param)
