"""OpenAI's Evals API objects (``/v1/evals``) through the official SDK's ``client.evals``:
created with their item schema and testing criteria checked, listed in OpenAI's pages,
read, renamed, deleted, each tenant's own; what TuneFleet cannot take is a 400 naming it
and the fix, and nothing is kept."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient
from openai import OpenAI

from conftest import auth as H

ITEM_SCHEMA = {
    "type": "object",
    "properties": {"question": {"type": "string"}, "answer": {"type": "string"}},
    "required": ["question", "answer"],
    "additionalProperties": False,
}
EXACT = {
    "type": "string_check",
    "name": "exact",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "eq",
}
CLOSE = {
    "type": "text_similarity",
    "name": "close",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "evaluation_metric": "fuzzy_match",
    "pass_threshold": 0.8,
}


def _sdk(client: TestClient, key: str) -> OpenAI:
    return OpenAI(base_url="http://testserver/v1", api_key=key, http_client=client, max_retries=0)


@pytest.fixture
def sdk(app_client: TestClient, key_a: str) -> OpenAI:
    return _sdk(app_client, key_a)


def _create(sdk: OpenAI, **changes: Any) -> Any:
    body: dict[str, Any] = {
        "name": "capitals",
        "data_source_config": {
            "type": "custom",
            "item_schema": ITEM_SCHEMA,
            "include_sample_schema": True,
        },
        "testing_criteria": [EXACT, CLOSE],
        "metadata": {"team": "geo"},
    } | changes
    return sdk.evals.create(**body)


def test_an_eval_is_created_read_listed_renamed_and_deleted_in_openais_shapes(
    sdk: OpenAI,
) -> None:
    made = _create(sdk)
    assert made.object == "eval" and made.id.startswith("eval-") and made.name == "capitals"
    assert made.metadata == {"team": "geo"} and made.created_at > 0
    config = made.data_source_config
    assert config.type == "custom"
    schema = config.schema_
    assert schema["required"] == ["item", "sample"]
    assert schema["properties"]["item"] == ITEM_SCHEMA  # type: ignore[index]
    assert "output_text" in schema["properties"]["sample"]["properties"]  # type: ignore[index]
    assert [c.type for c in made.testing_criteria] == ["string_check", "text_similarity"]
    assert made.testing_criteria[1].pass_threshold == 0.8  # type: ignore[union-attr]

    assert sdk.evals.retrieve(made.id).model_dump() == made.model_dump()
    others = [_create(sdk, name=f"e{i}") for i in range(3)]
    ids = [made.id, *(o.id for o in others)]
    page = sdk.evals.list(limit=2)
    assert [e.id for e in page.data] == ids[:2] and page.has_more
    assert page.first_id == ids[0] and page.last_id == ids[1]
    assert [e.id for e in sdk.evals.list(after=ids[1])] == ids[2:]  # the SDK pages on
    assert [e.id for e in sdk.evals.list(order="desc", limit=100).data] == ids[::-1]

    renamed = sdk.evals.update(made.id, name="world capitals", metadata={"team": "maps"})
    assert (renamed.name, renamed.metadata) == ("world capitals", {"team": "maps"})
    assert sdk.evals.list(order_by="updated_at", order="desc", limit=1).data[0].id == made.id
    assert [c.model_dump() for c in renamed.testing_criteria] == [
        c.model_dump() for c in made.testing_criteria
    ]

    deleted = sdk.evals.delete(made.id)
    assert (deleted.object, deleted.deleted, deleted.eval_id) == ("eval.deleted", True, made.id)
    with pytest.raises(openai.NotFoundError, match=made.id):
        sdk.evals.retrieve(made.id)
    assert made.id not in [e.id for e in sdk.evals.list(limit=100).data]


def test_another_tenants_evals_are_not_found(
    app_client: TestClient, sdk: OpenAI, key_b: str
) -> None:
    mine = _create(sdk)
    theirs = _sdk(app_client, key_b)
    assert theirs.evals.list().data == []
    for call in (
        lambda: theirs.evals.retrieve(mine.id),
        lambda: theirs.evals.update(mine.id, name="taken"),
        lambda: theirs.evals.delete(mine.id),
        lambda: theirs.evals.list(after=mine.id),
    ):
        with pytest.raises(openai.NotFoundError, match=f"no eval with id '{mine.id}'"):
            call()
    assert sdk.evals.retrieve(mine.id).name == "capitals"  # unchanged


SCHEMA_WITHOUT_SAMPLES = {"type": "custom", "item_schema": ITEM_SCHEMA}


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"data_source_config": {"type": "logs"}},
         "data_source_config type 'logs': TuneFleet keeps no log of chat completions"),
        ({"data_source_config": {"type": "stored_completions"}}, "use type 'custom'"),
        ({"data_source_config": {"type": "custom", "item_schema": {"type": "strng"}}},
         "item_schema is not a JSON Schema (draft 2020-12): at type"),
        ({"data_source_config": {"type": "custom", "item_schema": {"type": "array"}}},
         'give "type": "object"'),
        ({"data_source_config": {"type": "custom",
                                 "item_schema": {"type": "object", "maxProperties": 2**64}}},
         "item_schema cannot be stored as JSON here: Integer exceeds 64-bit range"),
        ({"data_source_config": SCHEMA_WITHOUT_SAMPLES},
         "testing criterion 'exact': {{sample.output_text}} reads the sample, and runs of "
         "this eval generate none; set data_source_config.include_sample_schema to true"),
        ({"testing_criteria": [{**EXACT, "reference": "{{item.answr}}"}]},
         "testing criterion 'exact': {{item.answr}}: item_schema has no property 'answr' "
         "(it has 'question', 'answer')"),
        ({"testing_criteria": [{**EXACT, "input": "{{sample.choices}}"}]},
         "use sample.output_text or sample.output_json.*"),
        ({"testing_criteria": [EXACT, {**CLOSE, "name": "exact"}]},
         "testing_criteria names 'exact' more than once"),
        ({"testing_criteria": [{k: v for k, v in CLOSE.items() if k != "pass_threshold"}]},
         "pass_threshold"),
        ({"testing_criteria": [{"type": "label_model", "name": "judge", "model": "m",
                                "input": [], "labels": ["a"], "passing_labels": ["a"]}]},
         "testing_criteria[0] of type 'label_model': model graders (label_model) are not "
         "available here yet"),
        ({"testing_criteria": [{"type": "python", "name": "py",
                                "source": "def grade(s, i): return 1"}]},
         "TUNEFLEET_PYTHON_GRADERS=true"),
        ({"testing_criteria": []}, "testing_criteria"),
        ({"metadata": {"k": 1}}, "metadata value of 'k' is 1, not a string"),
    ],
)  # fmt: skip
def test_an_eval_that_cannot_be_taken_is_a_400_naming_what_and_keeps_nothing(
    sdk: OpenAI, changes: dict[str, Any], needle: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        _create(sdk, **changes)
    assert needle in str(refused.value), refused.value
    assert sdk.evals.list().data == []


def test_item_variables_are_free_where_the_schema_allows_other_properties(
    sdk: OpenAI, app_client: TestClient, key_a: str
) -> None:
    """An item schema that does not close its properties may hold others: a criterion
    may read them. A python criterion is taken where the operator allows them."""
    open_schema = {**ITEM_SCHEMA, "additionalProperties": True}
    config = {"type": "custom", "item_schema": open_schema, "include_sample_schema": True}
    made = _create(
        sdk,
        data_source_config=config,
        testing_criteria=[{**EXACT, "reference": "{{item.extra.0}}"}],
    )
    assert made.testing_criteria[0].reference == "{{item.extra.0}}"  # type: ignore[union-attr]
    python = {"type": "python", "name": "py", "source": "def grade(s, i): return 1"}
    body = {"data_source_config": config, "testing_criteria": [python]}
    refused = app_client.post("/v1/evals", headers=H(key_a), json=body)
    assert refused.status_code == 400 and "TUNEFLEET_PYTHON_GRADERS" in refused.text
