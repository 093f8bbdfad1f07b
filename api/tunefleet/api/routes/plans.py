"""``POST /v1/plans``: a dry run of a job. Same body as ``POST /v1/fine_tuning/jobs``
(files are not needed and not checked), plus the device to plan for; answers with the
memory breakdown of what the job would run and the tuning chart's advice."""

from __future__ import annotations

import secrets
from typing import Any

from fastapi import APIRouter
from pydantic import Field

from tunefleet.api.deps import PrincipalDep, RegistryDep, SettingsDep
from tunefleet.api.openapi import Plan, ok
from tunefleet.platform.jobs import JobCreateRequest
from tunefleet.platform.planner import PlanDevice, plan_for_spec
from tunefleet.platform.spec import JobSpec, TuneFleetOptions

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
    body: PlanRequest, principal: PrincipalDep, registry: RegistryDep, settings: SettingsDep
) -> dict[str, Any]:
    registry.require(body.model)
    spec = JobSpec(
        job_id="plan", tenant_id=principal.tenant_id, model=body.model,
        training_file=body.training_file, validation_file=body.validation_file,
        hyperparameters=body.resolved_hyperparameters(),
        seed=body.seed if body.seed is not None else secrets.randbelow(2**31),
        suffix=body.suffix, tunefleet=body.tunefleet or TuneFleetOptions(),
    )  # fmt: skip
    device = PlanDevice.from_gb(
        body.device_memory_gb or settings.device_memory_gb,
        body.host_memory_gb or settings.host_memory_gb,
    )
    return plan_for_spec(
        registry.config(body.model),
        spec,
        device_bytes=device.memory_bytes,
        host_bytes=device.host_bytes,
    )
