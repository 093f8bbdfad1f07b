"""Runs of evals in OpenAI's shapes (``/v1/evals/{id}/runs``): what a run reads, how each
item is sampled and graded, and how a run and its output items are shown.

A run's ``data_source`` is one of OpenAI's:

- ``completions``: each item is sampled from ``model`` (a base model, or a fine-tuned
  model or checkpoint the tenant may call, resolved when the run is created) with the
  chat messages of ``input_messages``: a ``template`` whose ``{{item.x}}`` variables are
  put in per item, or an ``item_reference`` naming the item's own list of messages. The
  controller sends them through TuneFleet's serving path (``workers/_evals.py``).
- ``jsonl``: each line already holds its ``sample`` (``output_text``, or OpenAI's
  ``choices``); nothing is generated, the criteria grade what is there.

Either reads its items from ``source``: ``file_content`` (the items in the request) or
``file_id`` (a JSONL file of the tenant's, purpose ``evals``, one ``{"item": ...}`` per
line). Every item is checked against the eval's ``item_schema`` when the run is created,
and a refusal names the item and what is wrong, so a run never fails halfway on its data.

An output item passes when every criterion passes (``evals.py`` says when one does), fails
when one fails, and is an error when its sample could not be made (the serving error is in
``sample.error``) or a grader failed on it (its flag in the result).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator

from tunefleet.platform import sandbox
from tunefleet.platform.evals import (
    Criterion,
    PythonCriterion,
    StringCheckCriterion,
    python_pass_threshold,
)
from tunefleet.platform.graders import GraderFailed, render, run_grader
from tunefleet.platform.jobs import check_metadata
from tunefleet.platform.sandbox import Limits
from tunefleet.platform.settings import Settings

MAX_ITEMS = 10_000
MAX_MESSAGES = 64
QUEUED, IN_PROGRESS, COMPLETED, FAILED, CANCELED = (
    "queued",
    "in_progress",
    "completed",
    "failed",
    "canceled",
)
ACTIVE = (QUEUED, IN_PROGRESS)
# What a sample is made with where the run does not say: OpenAI's defaults.
DEFAULT_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "seed": 42}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FileContentSource(_Strict):
    type: Literal["file_content"]
    content: list[dict[str, Any]] = Field(min_length=1, max_length=MAX_ITEMS)


class FileIdSource(_Strict):
    type: Literal["file_id"]
    id: str = Field(min_length=1, max_length=64)


Source = Annotated[FileContentSource | FileIdSource, Field(discriminator="type")]


class TemplateMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str = Field(max_length=256 * 1024)
    type: Literal["message"] | None = None


class TemplateMessages(_Strict):
    type: Literal["template"]
    template: list[TemplateMessage] = Field(min_length=1, max_length=MAX_MESSAGES)


class ItemReference(_Strict):
    type: Literal["item_reference"]
    item_reference: str = Field(pattern=r"^item(\.[A-Za-z0-9_-]+)+$")


InputMessages = Annotated[TemplateMessages | ItemReference, Field(discriminator="type")]


class SamplingParams(_Strict):
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class CompletionsDataSource(_Strict):
    type: Literal["completions"]
    model: str = Field(min_length=1, max_length=256)
    input_messages: InputMessages
    source: Source
    sampling_params: SamplingParams | None = None


class JsonlDataSource(_Strict):
    type: Literal["jsonl"]
    source: Source


DataSource = Annotated[CompletionsDataSource | JsonlDataSource, Field(discriminator="type")]


class RunCreate(_Strict):
    name: str = Field(default="", max_length=256)
    metadata: dict[str, str] | None = None
    data_source: DataSource

    @field_validator("metadata", mode="before")
    @classmethod
    def _metadata(cls, v: Any) -> Any:
        return check_metadata(v)


def check_items(
    rows: list[Any], item_schema: dict[str, Any], *, with_samples: bool, where: str
) -> list[dict[str, Any]]:
    """``rows`` as a run keeps them (``{"item": ..., "sample"?: ...}``), each item checked
    against ``item_schema``; ``ValueError`` naming the first bad row and the fix."""
    from jsonschema import Draft202012Validator

    if len(rows) > MAX_ITEMS:
        raise ValueError(f"{where} has {len(rows)} items; a run takes at most {MAX_ITEMS}")
    validator = Draft202012Validator(item_schema)
    kept = []
    for i, row in enumerate(rows):
        at = f"{where} item {i}"
        if not isinstance(row, dict) or not isinstance(row.get("item"), dict):
            raise ValueError(f'{at}: each item is an object {{"item": {{...}}}}')
        if extra := sorted(set(row) - {"item", "sample"}):
            raise ValueError(f"{at}: unknown keys {extra}; an item has 'item' and 'sample'")
        error = next(iter(validator.iter_errors(row["item"])), None)
        if error is not None:
            path = "/".join(str(p) for p in error.path) or "its top level"
            raise ValueError(
                f"{at} does not match the eval's item_schema: at {path}, {error.message}"
            )
        if with_samples and sample_text(row.get("sample")) is None:
            raise ValueError(
                f"{at} has no sample to grade: a jsonl run's items each hold "
                '"sample": {"output_text": "..."} (or OpenAI\'s "choices")'
            )
        kept.append({"item": row["item"], **({"sample": row["sample"]} if with_samples else {})})
    return kept


def python_sandbox(settings: Settings) -> Limits | None:
    """The sandbox's limits for python graders here; None where they are off or cannot
    run (a python criterion then fails with OpenAI's server-error flag, saying so)."""
    if not settings.python_graders or sandbox.available():
        return None
    cpu = settings.python_grader_cpu_s
    return Limits(
        cpu_s=cpu, wall_s=2 * cpu + 1, memory_bytes=settings.python_grader_memory_mb << 20
    )


def read_jsonl(text: str, where: str) -> list[Any]:
    """The lines of an ``evals`` file, each a JSON object; ``ValueError`` naming the
    line otherwise."""
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError as exc:
            raise ValueError(f"{where} line {n} is not JSON: {exc}") from None
    if not rows:
        raise ValueError(f"{where} holds no items")
    return rows


def sample_text(sample: Any) -> str | None:
    """The text of a sample: its ``output_text``, or its first choice's message."""
    if not isinstance(sample, dict):
        return None
    if isinstance(sample.get("output_text"), str):
        return str(sample["output_text"])
    choices = sample.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        content = (choices[0].get("message") or {}).get("content")
        return content if isinstance(content, str) else None
    return None


def messages_for(input_messages: dict[str, Any], item: Any) -> list[dict[str, str]]:
    """The chat messages of one item; ``GraderFailed`` where a variable names nothing."""
    if input_messages["type"] == "template":
        return [
            {"role": m["role"], "content": render(m["content"], item, "")}
            for m in input_messages["template"]
        ]
    path = input_messages["item_reference"].split(".")[1:]
    value: Any = item
    for part in path:
        value = value.get(part) if isinstance(value, dict) else None
    if not isinstance(value, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value
    ):
        raise GraderFailed(
            "invalid_variable_error",
            f"{input_messages['item_reference']} is not a list of messages with a role and "
            "a content",
        )
    return [{"role": m["role"], "content": m["content"]} for m in value]


_CRITERION: TypeAdapter[Any] = TypeAdapter(Criterion)


def parse_criteria(stored: list[dict[str, Any]]) -> list[Any]:
    return [_CRITERION.validate_python(c) for c in stored]


def passes(criterion: Any, stored: dict[str, Any], score: float) -> bool:
    if isinstance(criterion, StringCheckCriterion):
        return score == 1.0
    if isinstance(criterion, PythonCriterion):
        return score >= python_pass_threshold(stored)
    return score >= float(stored["pass_threshold"])


def grade(
    criteria: list[Any],
    stored: list[dict[str, Any]],
    item: Any,
    text: str,
    python: Limits | None,
) -> tuple[str, list[dict[str, Any]]]:
    """(the item's status, its results in OpenAI's shape) for ``text`` sampled on
    ``item``: each criterion's score, whether it passed, and its grader's metadata."""
    results, status = [], "pass"
    for criterion, raw in zip(criteria, stored, strict=True):
        answer = run_grader(criterion, item, text, python=python)
        score = float(answer["reward"])
        failed = any(v is True for v in answer["metadata"]["errors"].values())
        passed = not failed and passes(criterion, raw, score)
        results.append(
            {
                "name": criterion.name,
                "type": criterion.type,
                "score": score,
                "passed": passed,
                "sample": None,
                "metadata": answer["metadata"],
            }
        )
        if failed:
            status = "error"
        elif not passed and status == "pass":
            status = "fail"
    return status, results


def summary(
    criteria: list[dict[str, Any]], items: list[tuple[str, list[dict[str, Any]], Any]]
) -> tuple[dict[str, int], list[dict[str, Any]], list[dict[str, Any]]]:
    """A run's ``result_counts``, ``per_testing_criteria_results`` and
    ``per_model_usage`` from its output items ``(status, results, sample)``."""
    counts = {"total": len(items), "passed": 0, "failed": 0, "errored": 0}
    per = {c["name"]: {"testing_criteria": c["name"], "passed": 0, "failed": 0} for c in criteria}
    usage: dict[str, dict[str, Any]] = {}
    for status, results, sample in items:
        counts[{"pass": "passed", "fail": "failed"}.get(status, "errored")] += 1
        for r in results:
            if r["name"] in per:
                per[r["name"]]["passed" if r["passed"] else "failed"] += 1
        if isinstance(sample, dict) and sample.get("model") and sample.get("usage"):
            u = usage.setdefault(
                sample["model"],
                {
                    "model_name": sample["model"],
                    "invocation_count": 0,
                    "prompt_tokens": 0,
                    "completion_tokens": 0,
                    "total_tokens": 0,
                    "cached_tokens": 0,
                },
            )
            u["invocation_count"] += 1
            for key in ("prompt_tokens", "completion_tokens", "total_tokens", "cached_tokens"):
                u[key] += int(sample["usage"].get(key) or 0)
    return counts, list(per.values()), list(usage.values())


def run_view(row: Any) -> dict[str, Any]:
    """An ``EvalRun`` row in OpenAI's shape."""
    return {
        "object": "eval.run",
        "id": row.id,
        "eval_id": row.eval_id,
        "name": row.name,
        "status": row.status,
        "model": row.model,
        "created_at": row.created_ns // 10**9,
        "data_source": row.data_source,
        "metadata": row.metadata_ or {},
        "result_counts": row.result_counts,
        "per_testing_criteria_results": row.per_testing_criteria_results,
        "per_model_usage": row.per_model_usage,
        "error": row.error,
        "report_url": f"/ui/evals/{row.eval_id}/runs/{row.id}",
        "shared_with_openai": False,
    }


def output_item_view(row: Any, eval_id: str) -> dict[str, Any]:
    """An ``EvalOutputItem`` row in OpenAI's shape."""
    return {
        "object": "eval.run.output_item",
        "id": row.id,
        "run_id": row.run_id,
        "eval_id": eval_id,
        "created_at": row.created_ns // 10**9,
        "status": row.status,
        "datasource_item_id": row.item_index,
        "datasource_item": row.datasource_item,
        "results": row.results,
        "sample": row.sample,
    }
