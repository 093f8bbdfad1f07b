"""Properties of the job spec (Hypothesis): any input either validates or is refused with
pydantic's ``ValidationError`` (which the API turns into a 400 naming the field), never
another exception; and a spec that validated comes back equal from its JSON, as the
database stores it and the workers read it."""

from __future__ import annotations

import json
import os
import types
import typing
from typing import Any, Literal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from tunefleet.platform._defaults import settle
from tunefleet.platform.errors import InvalidRequest
from tunefleet.platform.jobs import JobCreateRequest
from tunefleet.platform.planner import GiB, resolve_spec
from tunefleet.platform.spec import LINEAR_MODULES, JobSpec, TuneFleetOptions

SETTINGS = settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    # the same examples every run (CI stays green or red for a reason); FUZZ_SEED=1 with
    # pytest --hypothesis-seed=N explores others
    derandomize=not os.environ.get("FUZZ_SEED"),
    database=None,
)


def rarely(common: st.SearchStrategy[Any], rare: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``rare`` one time in eight (``one_of`` would pick it half the time)."""
    bits = st.tuples(st.booleans(), st.booleans(), st.booleans())
    return bits.flatmap(lambda b: rare if all(b) else common)


junk = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()  # NaN and infinities too
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=6,
)
# mostly small numbers, within most fields' bounds; now and then any number at all
integers = rarely(st.integers(1, 32), st.integers(-(2**65), 2**65) | st.just(2**63))
reals = rarely(st.floats(0.01, 0.9) | st.integers(1, 8), st.floats() | integers)
module_names = st.sampled_from([*LINEAR_MODULES, "all-linear", "lm_head", "", "q_proj\n"])


def values_for(annotation: Any) -> st.SearchStrategy[Any]:
    """Values of a field's type, mostly within its bounds, now and then past them."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return st.sampled_from(args)
    if origin in (typing.Union, types.UnionType):
        return st.one_of([values_for(a) for a in args])
    if origin is list:
        return st.lists(module_names | st.text(max_size=8), max_size=4)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:  # tuple[X, ...]
        return st.lists(values_for(args[0]), max_size=3)
    if origin is dict:
        return st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=20)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return objects_for(annotation)
    if annotation is bool:
        return st.booleans()
    if annotation is int:
        return integers
    if annotation is float:
        return reals
    if annotation is str:
        return st.text(max_size=12)
    if annotation is type(None):
        return st.none()
    raise AssertionError(f"no strategy for {annotation!r}")


def objects_for(model: type[BaseModel]) -> st.SearchStrategy[dict[str, Any]]:
    """Dicts of ``model``'s required fields and any of its others; now and then one of
    them (or an unknown one) holds junk, or a required one is missing."""
    fields = {name: values_for(f.annotation) for name, f in model.model_fields.items()}
    required = {n: s for n, s in fields.items() if model.model_fields[n].is_required()}
    optional = {n: s for n, s in fields.items() if n not in required}
    whole = st.fixed_dictionaries(required, optional=optional)
    spoiled = st.builds(
        lambda obj, name, value, drop: (
            {k: v for k, v in obj.items() if k != name} if drop else {**obj, name: value}
        ),
        whole,
        st.sampled_from([*fields, "unknown"]),
        junk,
        st.booleans(),
    )
    return rarely(whole, spoiled)


def validate(model: type[BaseModel], data: Any) -> BaseModel | None:
    """The validated model, or None when pydantic refused it (the only refusal allowed)."""
    try:
        return model.model_validate(data)
    except ValidationError:
        return None


@pytest.mark.parametrize("model", [TuneFleetOptions, JobSpec])
def test_the_strategy_reaches_valid_objects(model: type[BaseModel]) -> None:
    """Guards the properties below against a strategy that only ever makes junk."""
    found = []

    @settings(
        max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(objects_for(model))
    def collect(data: dict[str, Any]) -> None:
        if validate(model, data) is not None:
            found.append(data)

    collect()
    assert len(found) >= 5


@SETTINGS
@given(objects_for(TuneFleetOptions))
def test_options_validate_or_refuse_and_round_trip(data: dict[str, Any]) -> None:
    options = validate(TuneFleetOptions, data)
    if options is not None:
        assert TuneFleetOptions.model_validate_json(options.model_dump_json()) == options


@SETTINGS
@given(objects_for(JobSpec))
def test_specs_validate_or_refuse_and_round_trip(data: dict[str, Any]) -> None:
    spec = validate(JobSpec, data)
    if spec is not None:
        stored = json.loads(spec.model_dump_json())  # what the jobs.spec column holds
        assert JobSpec.model_validate(stored) == spec
        assert JobSpec.model_validate_json(spec.model_dump_json()) == spec


@SETTINGS
@given(objects_for(JobCreateRequest))
def test_create_bodies_validate_or_refuse(data: dict[str, Any]) -> None:
    """The API's body, from JSON as it arrives; its hyperparameters always make a valid
    spec's (bounds checked where the request names them)."""
    try:
        request = JobCreateRequest.model_validate_json(json.dumps(data))
    except ValidationError:
        return
    except ValueError:  # NaN or an infinity: not JSON, json.dumps wrote it anyway
        assert "NaN" in json.dumps(data) or "Infinity" in json.dumps(data)
        return
    options = request.tunefleet or TuneFleetOptions()
    for examples in (None, 1, 120, 10**6):
        settle(
            request.asked_hyperparameters(),
            method=options.method,
            config=SMOLLM,
            examples=examples,
            workers=options.resources.num_workers,
        )


# SmolLM2-135M's shape: what the planner plans every new job for.
SMOLLM = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "tie_word_embeddings": True,
}


@SETTINGS
@given(
    st.builds(
        lambda d, t: {**d, "tunefleet": t}, objects_for(JobSpec), objects_for(TuneFleetOptions)
    )
)
def test_a_valid_spec_is_planned_or_refused_with_a_400(data: dict[str, Any]) -> None:
    """Creating a job plans its spec: the planner either settles it (into a spec that is
    itself valid) or refuses it with InvalidRequest, never another exception (a 500)."""
    spec = validate(JobSpec, data)
    if spec is None:
        return
    try:
        settled, plan = resolve_spec(SMOLLM, spec, device_bytes=80 * GiB, host_bytes=256 * GiB)
    except InvalidRequest:
        return
    assert JobSpec.model_validate(settled.model_dump()) == settled
    assert plan["object"] == "fine_tuning.plan"
