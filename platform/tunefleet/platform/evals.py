"""Evals in OpenAI's shapes (``/v1/evals``): what a tenant measures its models with.

An eval is a data source config and testing criteria:

- ``data_source_config`` of type ``custom``: ``item_schema``, the JSON Schema (Draft
  2020-12, checked with ``jsonschema``) of each item of the data a run reads, an object;
  with ``include_sample_schema`` a run generates a sample per item (a model's answer) and
  the criteria may read it. It is shown as OpenAI shows it: ``schema``, an object schema
  with ``item`` and, with samples, ``sample``. OpenAI's ``logs`` and
  ``stored_completions`` read its stored chat completions; TuneFleet keeps none, and
  refuses them by name.
- ``testing_criteria``: graders (``graders.py``) with a name, each a pass or a fail per
  item: ``string_check`` passes on a score of 1, ``text_similarity`` at its
  ``pass_threshold`` (required, as OpenAI's), ``python`` at its ``pass_threshold`` (0.5
  when not given) where the operator allows python graders. Model graders
  (``label_model``, ``score_model``) are not available yet: refused by name.

Every template variable of a criterion is checked against the config when the eval is
created: ``{{item.x}}`` must name a property of ``item_schema`` where it lists them (and
does not allow others), and ``{{sample.*}}`` needs ``include_sample_schema``. Each refusal
names the criterion, the variable and the fix.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tunefleet.platform.graders import (
    PythonGrader,
    StringCheckGrader,
    TextSimilarityGrader,
    refused_type,
    template_variables,
)
from tunefleet.platform.jobs import check_metadata

MAX_SCHEMA_BYTES = 64 * 1024
MAX_CRITERIA = 32
PYTHON_PASS_THRESHOLD = 0.5

# What a run's sample of an item holds (OpenAI's sample namespace): the model's chat
# completion, its text, and that text parsed as JSON where it is JSON.
SAMPLE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "model": {"type": "string"},
        "choices": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "index": {"type": "integer"},
                    "message": {
                        "type": "object",
                        "properties": {
                            "role": {"type": "string", "enum": ["assistant"]},
                            "content": {"type": ["string", "null"]},
                        },
                        "required": ["role"],
                    },
                    "finish_reason": {"type": "string"},
                },
                "required": ["index", "message", "finish_reason"],
            },
        },
        "output_text": {"type": "string"},
        "output_json": {"type": "object"},
    },
    "required": ["model", "choices"],
}


class CustomDataSourceConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["custom"]
    item_schema: dict[str, Any] = Field(description="The JSON Schema of each item (an object).")
    include_sample_schema: bool = Field(
        default=False, description="Runs generate a sample per item, which criteria may read."
    )

    @field_validator("item_schema")
    @classmethod
    def _schema(cls, v: dict[str, Any]) -> dict[str, Any]:
        from jsonschema import Draft202012Validator
        from jsonschema.exceptions import SchemaError

        try:
            size = len(orjson.dumps(v))
        except orjson.JSONEncodeError as exc:  # an integer past 64 bits
            raise ValueError(f"item_schema cannot be stored as JSON here: {exc}") from None
        if size > MAX_SCHEMA_BYTES:
            raise ValueError(f"item_schema is {size} bytes of JSON; at most {MAX_SCHEMA_BYTES}")
        try:
            Draft202012Validator.check_schema(v)
        except SchemaError as exc:
            where = "/".join(str(p) for p in exc.path) or "its top level"
            raise ValueError(
                f"item_schema is not a JSON Schema (draft 2020-12): at {where}, {exc.message}"
            ) from None
        if v.get("type") != "object":
            raise ValueError(
                f'item_schema describes each item, a JSON object: give "type": "object" '
                f"(it has {orjson.dumps(v.get('type')).decode()})"
            )
        return v

    def view(self) -> dict[str, Any]:
        """As OpenAI shows it: one object schema with the ``item`` (and ``sample``)
        namespaces."""
        properties = {"item": self.item_schema}
        if self.include_sample_schema:
            properties["sample"] = SAMPLE_SCHEMA
        return {
            "type": "custom",
            "schema": {"type": "object", "properties": properties, "required": list(properties)},
        }


class StringCheckCriterion(StringCheckGrader):
    """Passes where its score is 1."""


class TextSimilarityCriterion(TextSimilarityGrader):
    pass_threshold: float = Field(ge=0, le=1, description="A score at least this passes.")


class PythonCriterion(PythonGrader):
    pass_threshold: float | None = Field(
        default=None, description=f"A score at least this passes ({PYTHON_PASS_THRESHOLD} unset)."
    )


Criterion = Annotated[
    StringCheckCriterion | TextSimilarityCriterion | PythonCriterion,
    Field(discriminator="type"),
]

_DATA_SOURCES = {
    "logs": "TuneFleet keeps no log of chat completions to read",
    "stored_completions": "TuneFleet stores no chat completions to read",
}


class EvalCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(default="", max_length=256)
    metadata: dict[str, str] | None = Field(default=None, description="Up to 16 string pairs.")
    data_source_config: CustomDataSourceConfig
    testing_criteria: list[Criterion] = Field(min_length=1, max_length=MAX_CRITERIA)

    @model_validator(mode="before")
    @classmethod
    def _refused(cls, data: Any) -> Any:
        """OpenAI's shapes TuneFleet does not take, each named with why and the fix."""
        if not isinstance(data, dict):
            return data
        config = data.get("data_source_config")
        kind = config.get("type") if isinstance(config, dict) else None
        if isinstance(kind, str) and kind in _DATA_SOURCES:
            raise ValueError(
                f"data_source_config type {kind!r}: {_DATA_SOURCES[kind]}; use type "
                "'custom' with the item_schema of your data"
            )
        criteria = data.get("testing_criteria")
        for i, criterion in enumerate(criteria if isinstance(criteria, list) else []):
            if (why := refused_type(criterion)) is not None:
                raise ValueError(
                    f"testing_criteria[{i}] of type {criterion['type']!r}: {why}; use "
                    "string_check, text_similarity or python"
                )
        return data

    @field_validator("metadata", mode="before")
    @classmethod
    def _metadata(cls, v: Any) -> Any:
        return check_metadata(v)

    @model_validator(mode="after")
    def _criteria(self) -> EvalCreate:
        names = [c.name for c in self.testing_criteria]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(
                f"testing_criteria names {', '.join(map(repr, twice))} more than once; "
                "each criterion's name is its column in a run's results: make them unique"
            )
        for criterion in self.testing_criteria:
            for text in _templates(criterion):
                for variable in template_variables(text):
                    _check_variable(criterion.name, variable, self.data_source_config)
        return self


class EvalUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str | None = Field(default=None, max_length=256)
    metadata: dict[str, str] | None = Field(default=None, description="Up to 16 string pairs.")

    @field_validator("metadata", mode="before")
    @classmethod
    def _metadata(cls, v: Any) -> Any:
        return check_metadata(v)


def _templates(criterion: Any) -> list[str]:
    if isinstance(criterion, StringCheckCriterion | TextSimilarityCriterion):
        return [criterion.input, criterion.reference]
    return []  # python: its code reads item and sample itself


def _check_variable(criterion: str, variable: str, config: CustomDataSourceConfig) -> None:
    namespace, *path = variable.split(".")
    where = f"testing criterion {criterion!r}: {{{{{variable}}}}}"
    if namespace == "sample":
        if not config.include_sample_schema:
            raise ValueError(
                f"{where} reads the sample, and runs of this eval generate none; set "
                "data_source_config.include_sample_schema to true"
            )
        if path not in (["output_text"],) and path[:1] != ["output_json"]:
            raise ValueError(f"{where}: use sample.output_text or sample.output_json.*")
        return
    if namespace != "item" or not path:
        raise ValueError(f"{where}: use item.*, sample.output_text or sample.output_json.*")
    schema = config.item_schema
    properties = schema.get("properties")
    if not isinstance(properties, dict) or schema.get("additionalProperties") is not False:
        return  # the schema allows other properties
    if path[0] not in properties:
        raise ValueError(
            f"{where}: item_schema has no property {path[0]!r} (it has "
            f"{', '.join(map(repr, properties)) or 'none'}); name one of them, or add it "
            "to item_schema"
        )


def python_pass_threshold(criterion: dict[str, Any]) -> float:
    """The score at which a stored python criterion passes."""
    threshold = criterion.get("pass_threshold")
    return PYTHON_PASS_THRESHOLD if threshold is None else float(threshold)


def eval_view(row: Any) -> dict[str, Any]:
    """An ``Eval`` row in OpenAI's shape."""
    return {
        "object": "eval",
        "id": row.id,
        "name": row.name,
        "created_at": row.created_ns // 10**9,
        "metadata": row.metadata_ or {},
        "data_source_config": row.data_source_config,
        "testing_criteria": row.testing_criteria,
    }
