"""``/v1/fine_tuning/alpha/graders``: OpenAI's grader routes, run here
(``platform/graders.py``): ``validate`` checks a grader, ``run`` scores one model sample
with it. Any key may call them; they touch no tenant's data."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, model_validator

from tunefleet.api._deps import PrincipalDep, SettingsDep
from tunefleet.api._openapi import ok
from tunefleet.platform import sandbox
from tunefleet.platform.errors import InvalidRequest
from tunefleet.platform.eval_runs import python_sandbox
from tunefleet.platform.graders import MAX_TEXT, Grader, refused_type, run_grader, uses_python
from tunefleet.platform.settings import Settings

router = APIRouter(prefix="/v1/fine_tuning/alpha/graders", tags=["graders"])


class _WithGrader(BaseModel):
    model_config = ConfigDict(extra="forbid")
    grader: Grader

    @model_validator(mode="before")
    @classmethod
    def _supported(cls, data: Any) -> Any:
        grader = data.get("grader") if isinstance(data, dict) else None
        graders = grader.get("graders") if isinstance(grader, dict) else None
        inner = list(graders.values()) if isinstance(graders, dict) else [graders]
        for g in [grader, *inner]:
            if (why := refused_type(g)) is not None and isinstance(g, dict):
                raise ValueError(
                    f"grader type {g['type']!r}: {why}; use string_check, text_similarity or multi"
                )
        return data


class GraderValidate(_WithGrader):
    pass


class GraderRun(_WithGrader):
    model_sample: str = Field(max_length=MAX_TEXT, description="The sample to grade.")
    item: Any = Field(default=None, description="The dataset item of the `item` namespace.")


def python_limits(grader: Any, settings: Settings) -> sandbox.Limits | None:
    """The sandbox's limits for ``grader``'s python graders; a 400 where they cannot run
    here (None: it holds none)."""
    if not uses_python(grader):
        return None
    if not settings.python_graders:
        raise InvalidRequest(
            "python graders run your code, and this deployment does not allow them (the "
            "operator sets TUNEFLEET_PYTHON_GRADERS=true to); use string_check, "
            "text_similarity or multi",
            param="grader",
        )
    if why := sandbox.available():
        raise InvalidRequest(f"python graders cannot run here: {why}", param="grader")
    return python_sandbox(settings)


@router.post("/validate", responses=ok({"description": "The grader, as it will run."}))
def validate_grader(body: GraderValidate, _: PrincipalDep, settings: SettingsDep) -> dict[str, Any]:
    """The grader as TuneFleet reads it; a 400 naming what is wrong otherwise."""
    python_limits(body.grader, settings)
    return {"grader": body.grader.model_dump(mode="json", exclude_none=True)}


@router.post("/run", responses=ok({"description": "The reward and how it was reached."}))
def run(body: GraderRun, _: PrincipalDep, settings: SettingsDep) -> dict[str, Any]:
    """The grader's reward for ``model_sample`` (and ``item``), in OpenAI's shape."""
    limits = python_limits(body.grader, settings)
    return run_grader(body.grader, body.item, body.model_sample, python=limits)
