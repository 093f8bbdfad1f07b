"""``POST /v1/plans``: a dry run of a job. Same body as ``POST /v1/fine_tuning/jobs``
(files are not needed and not checked: a training file of the caller's settles "auto"
epochs and batch size as creating the job would), plus the device to plan for; answers
with the memory breakdown of what the job would run, as creating it would settle it
(``jobs.dry_run``), and the tuning chart's advice."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import Field

from tunefleet.api._deps import PrincipalDep, RegistryDep, SessionDep, SettingsDep
from tunefleet.api._openapi import Plan, ok
from tunefleet.platform.jobs import JobCreateRequest, dry_run, training_examples
from tunefleet.platform.planner import PlanDevice

router = APIRouter(prefix="/v1/plans", tags=["planner"])


class PlanRequest(JobCreateRequest):
    # Upper bounds far above any machine, so that the byte counts stay finite numbers.
    device_memory_gb: float | None = Field(
        default=None,
        gt=0,
        le=1_000_000,
        description="Accelerator memory per worker (GiB); default from settings.",
    )
    host_memory_gb: float | None = Field(
        default=None,
        gt=0,
        le=1_000_000,
        description="Host memory per worker for CPU offload (GiB).",
    )


@router.post("", responses=ok(Plan))
async def create_plan(
    body: PlanRequest,
    principal: PrincipalDep,
    registry: RegistryDep,
    settings: SettingsDep,
    session: SessionDep,
) -> dict[str, Any]:
    registry.require(body.model)
    device = PlanDevice.from_gb(
        body.device_memory_gb or settings.device_memory_gb,
        body.host_memory_gb or settings.host_memory_gb,
    )
    examples = (
        training_examples(session, principal.tenant_id, body.training_file)
        if body.asks_auto_from_data()
        else None
    )
    return dry_run(
        body,
        registry.config(body.model),
        tenant_id=principal.tenant_id,
        device=device,
        examples=examples,
    )
