"""Fine-tuning jobs: the create request, turning it into a spec, and OpenAI-shaped views.

``JobCreateRequest`` is the body of ``POST /v1/fine_tuning/jobs``: OpenAI's fields plus
TuneFleet's own controls under ``tunefleet``. Unknown top-level fields (OpenAI fields
TuneFleet does not act on) are accepted and kept in the job's stored request, never
silently dropped.
"""

from __future__ import annotations

import json
import math
import re
import secrets
import time
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from sqlalchemy import Row, func, select
from sqlalchemy.orm import Session

from tunefleet.platform._defaults import Settled, settle
from tunefleet.platform._new_job import JOB_COLUMNS as JOB_COLUMNS  # re-exported
from tunefleet.platform._new_job import WAITING as WAITING  # re-exported
from tunefleet.platform._new_job import FirstEvent, NewJob, insert_job
from tunefleet.platform.db import File, Job, JobEvent
from tunefleet.platform.errors import InvalidRequest, NotFound, QuotaExceeded
from tunefleet.platform.ids import new_id
from tunefleet.platform.models import ModelRegistry
from tunefleet.platform.outbound import PUBLIC_ONLY, OutboundPolicy, OutboundRefused
from tunefleet.platform.planner import (
    FUSED_TYPES,
    ModelShape,
    PlanDevice,
    chart_of_plan,
    plan_for_spec,
    resolve_spec,
)
from tunefleet.platform.spec import (
    AUTO_PRECISION,
    BASE_LEARNING_RATE,
    DpoOptions,
    Integration,
    JobSpec,
    Objective,
    TrackingSpaces,
    TuneFleetOptions,
    dpo_problem,
    layer_modules,
    model_targets,
)
from tunefleet.platform.status import JobStatus
from tunefleet.platform.tenants import Principal

# The default tracking spaces (Settings' defaults): each tenant's names under its own.
TENANT_SPACES = TrackingSpaces()
SUFFIX = re.compile(r"[A-Za-z0-9_-]{1,64}")  # a fine-tuned model name's part


class HyperparametersIn(BaseModel):
    """OpenAI's hyperparameters; each may be ``"auto"``."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    n_epochs: int | Literal["auto"] = Field(
        default="auto", description="Passes over the data (1-50)."
    )
    batch_size: int | Literal["auto"] = Field(
        default="auto", description="Global batch size (1-4096)."
    )
    learning_rate_multiplier: float | Literal["auto"] = Field(
        default="auto", description="Scales the method's base learning rate (above 0, at most 100)."
    )

    @field_validator("n_epochs", "batch_size", "learning_rate_multiplier", mode="before")
    @classmethod
    def _bounded(cls, v: Any, info: ValidationInfo) -> Any:
        """The spec's bounds (``Hyperparameters``), checked here so that the refusal names
        the field as the request spelled it; a number sent as a string ("0") is held to
        them too, and a bool is not a number (pydantic would read true as 1)."""
        if isinstance(v, bool):
            raise ValueError("must be 'auto' or a number, not true or false")
        if v == "auto":
            return v
        number = v
        if isinstance(v, str):
            try:
                number = float(v)
            except ValueError:
                return v  # pydantic names the wrong type
        if not isinstance(number, int | float):
            return v
        low, high = _HYPERPARAMETER_BOUNDS[info.field_name or ""]
        if not math.isfinite(number) or not low <= number <= high or number == 0:
            span = f"above 0 and at most {high}" if low == 0 else f"from {low} to {high}"
            raise ValueError(f"must be 'auto' or a number {span}")
        return v


_HYPERPARAMETER_BOUNDS = {
    "n_epochs": (1, 50),
    "batch_size": (1, 4096),
    "learning_rate_multiplier": (0, 100),  # above 0
}


class SupervisedIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    hyperparameters: HyperparametersIn = Field(default_factory=HyperparametersIn)


class DpoHyperparametersIn(HyperparametersIn):
    """OpenAI's DPO hyperparameters: the supervised ones and ``beta``."""

    beta: float | Literal["auto"] = Field(
        default="auto", description="DPO's beta (above 0, at most 10); auto: 0.1."
    )

    @field_validator("beta", mode="before")
    @classmethod
    def _beta(cls, v: Any) -> Any:
        if isinstance(v, bool) or (
            isinstance(v, int | float) and not (math.isfinite(v) and 0 < v <= 10)
        ):
            raise ValueError("must be 'auto' or a number above 0 and at most 10")
        return v


class DpoIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    hyperparameters: DpoHyperparametersIn = Field(default_factory=DpoHyperparametersIn)


class MethodIn(BaseModel):
    """OpenAI's ``method`` object: ``supervised`` or ``dpo`` (preference tuning)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["supervised", "dpo"] = "supervised"
    supervised: SupervisedIn | None = None
    dpo: DpoIn | None = None

    @model_validator(mode="after")
    def _matching_object(self) -> MethodIn:
        other = "dpo" if self.type == "supervised" else "supervised"
        if getattr(self, other) is not None:
            raise ValueError(
                f"method.type is {self.type!r} but the body sets method.{other}; put the "
                f"hyperparameters under method.{self.type}"
            )
        return self


def _too_big(value: Any) -> int | None:
    """The first integer in ``value`` (nested lists and objects too) outside 64 bits."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value if not -(2**63) <= value < 2**64 else None
    children = value.values() if isinstance(value, dict) else value
    if isinstance(value, dict | list):
        for child in children:
            if (big := _too_big(child)) is not None:
                return big
    return None


_DEFAULT_OPTIONS = TuneFleetOptions()


class JobCreateRequest(BaseModel):
    """Body of ``POST /v1/fine_tuning/jobs``."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str = Field(description="Base model name, from GET /v1/models.")
    training_file: str = Field(description="Id of an uploaded file with purpose fine-tune.")
    validation_file: str | None = Field(default=None, description="Optional evaluation file.")
    hyperparameters: HyperparametersIn | None = Field(
        default=None, description="Deprecated by OpenAI in favour of method; still honoured."
    )
    method: MethodIn | None = Field(default=None, description="Training method and its knobs.")
    suffix: str | None = Field(default=None, description="Up to 64 chars in fine_tuned_model.")
    seed: int | None = Field(default=None, ge=0, le=2**31 - 1, description="Reproducibility.")
    metadata: dict[str, str] | None = Field(default=None, description="Up to 16 string pairs.")
    tunefleet: TuneFleetOptions | None = Field(
        default=None, description="TuneFleet's own controls: PEFT method, resources, lengths."
    )
    integrations: list[Integration] | None = Field(
        default=None,
        max_length=5,
        description="Weights & Biases (OpenAI's) or MLflow (TuneFleet's) runs that get the "
        "job's config and metrics.",
    )

    @property
    def options(self) -> TuneFleetOptions:
        """``tunefleet`` as asked, else the defaults (one instance: the options are frozen)."""
        return self.tunefleet or _DEFAULT_OPTIONS

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v: str | None) -> str | None:
        if v is not None and not SUFFIX.fullmatch(v):
            raise ValueError(f"suffix {v!r} must be 1-64 letters, digits, '-' or '_'")
        return v

    @field_validator("metadata", mode="before")
    @classmethod
    def _metadata(cls, v: Any) -> Any:
        return check_metadata(v)

    @model_validator(mode="after")
    def _storable_extras(self) -> JobCreateRequest:
        """Fields TuneFleet does not know are kept with the stored request; a JSON column
        holds integers of at most 64 bits, so a larger one is refused, not a 500."""
        for key, value in (self.model_extra or {}).items():
            if (big := _too_big(value)) is not None:
                raise ValueError(
                    f"field {key!r} holds the integer {big}, beyond 64 bits, which cannot be "
                    "stored; send it as a string or leave the field out"
                )
        return self

    def asked_hyperparameters(self) -> dict[str, Any]:
        """The hyperparameters as asked (``method`` wins over the deprecated top-level
        ``hyperparameters``), each a value or "auto" (``defaults.settle`` resolves them)."""
        hp: HyperparametersIn = self.hyperparameters or HyperparametersIn()
        if self.method and self.method.supervised:
            hp = self.method.supervised.hyperparameters
        if self.method and self.method.dpo:
            hp = self.method.dpo.hyperparameters
        asked = hp.model_dump()
        asked.pop("beta", None)
        return asked

    @property
    def objective(self) -> Objective:
        return self.method.type if self.method else "supervised"

    def asked_beta(self) -> float | Literal["auto"]:
        dpo = self.method.dpo if self.method else None
        return dpo.hyperparameters.beta if dpo else "auto"

    def asks_auto_from_data(self) -> bool:
        """Whether an "auto" here depends on the training file's size."""
        asked = self.asked_hyperparameters()
        return "auto" in (asked["n_epochs"], asked["batch_size"])


def _explain_waiting(session: Session, principal: Principal) -> None:
    """Raise 429 when the tenant's waiting jobs are at its cap (after an insert that did
    not happen with every file usable)."""
    waiting = session.scalar(
        select(func.count())
        .select_from(Job)
        .where(Job.tenant_id == principal.tenant_id, Job.status.in_(WAITING))
    )
    if waiting is not None and waiting >= principal.max_waiting_jobs:
        raise QuotaExceeded(
            f"tenant {principal.tenant_name!r} has {waiting} jobs waiting to run "
            f"(validating_files or queued), its limit of {principal.max_waiting_jobs}; "
            "create this job once some have started, cancel waiting ones, or ask an admin "
            "to raise max_waiting_jobs",
            code="too_many_waiting_jobs",
        )


def _explain_unusable(
    session: Session, principal: Principal, file_id: str, param: str, objective: Objective
) -> None:
    """Raise the error that says why ``file_id`` cannot be used for a job (missing, wrong
    purpose, not processed). Runs only after an insert found no usable file."""
    files = File.__table__.c
    row = (
        session.connection()
        .execute(
            select(files.purpose, files.status, files.format).where(
                files.id == file_id, files.tenant_id == principal.tenant_id
            )
        )
        .first()
    )
    if row is None:
        raise NotFound(f"no file with id {file_id!r}; upload one with POST /v1/files", param=param)
    purpose, status, fmt = row
    if purpose != "fine-tune":
        raise InvalidRequest(
            f"file {file_id} has purpose {purpose!r}; upload it with purpose 'fine-tune'",
            param=param,
        )
    if status != "processed":
        raise InvalidRequest(f"file {file_id} is {status}, not processed", param=param)
    if objective == "dpo" and fmt != "preference":
        raise InvalidRequest(
            f"file {file_id} holds {fmt or 'supervised'} examples, and a DPO job trains on "
            "preference pairs: give it a file of lines with input.messages, "
            "preferred_output and non_preferred_output (OpenAI's preference format)",
            param=param,
        )
    if objective != "dpo" and fmt == "preference":
        raise InvalidRequest(
            f"file {file_id} holds preference pairs (input, preferred_output, "
            "non_preferred_output), which a supervised job cannot train on: create a "
            'preference tuning job (method: {"type": "dpo"}) or give this job chat, '
            "prompt/completion, alpaca or text data",
            param=param,
        )


def training_examples(session: Session, tenant_id: str, file_id: str) -> int | None:
    """The number of examples in the tenant's file ``file_id`` (None: no such file, or
    stored before files counted them): what "auto" epochs and batch size follow.

    Remembered per process: a file never changes once processed and its id is never given
    again, so job creation reads it once per file (creation stays one statement on
    PostgreSQL: ``_create_statement``); whether the file is still usable is the insert's
    own check."""
    key = (tenant_id, file_id)
    if (known := _EXAMPLES.get(key)) is not None:
        return known
    stats = session.scalar(
        select(File.stats).where(File.id == file_id, File.tenant_id == tenant_id)
    )
    examples = (stats or {}).get("examples")
    if not isinstance(examples, int):
        return None
    if len(_EXAMPLES) >= _EXAMPLES_MAX:
        _EXAMPLES.clear()
    _EXAMPLES[key] = examples
    return examples


_EXAMPLES: dict[tuple[str, str], int] = {}  # (tenant, file id) -> examples
_EXAMPLES_MAX = 65_536


def build_spec(
    req: JobCreateRequest,
    *,
    job_id: str,
    tenant_id: str,
    config: dict[str, Any],
    examples: int | None,
) -> tuple[JobSpec, Settled]:
    """The spec a job of ``req`` runs on a model of ``config`` with a training file of
    ``examples``, before the planner settles its memory settings (``resolve_spec``), and
    what its "auto" hyperparameters settled on: the one builder behind job creation and
    the dry runs (``POST /v1/plans``, ``tunefleet plan``), with the checks that need the
    model (BitFit needs bias terms)."""
    options = req.options
    if options.method == "bitfit" and not (
        config.get("bias") or ModelShape.from_config(config).bias_params  # Qwen2's q, k, v
    ):
        raise InvalidRequest(
            f"BitFit trains only the bias terms, and {req.model!r} has none "
            "(attention_bias and mlp_bias are off); choose another tunefleet.method, "
            "e.g. 'lora' or 'ia3'",
            param="tunefleet.method",
        )
    fused = config.get("model_type") in FUSED_TYPES
    for methods, field, targets in (
        (("lora", "qlora"), "tunefleet.lora.target_modules", options.lora.target_modules),
        (("ia3",), "tunefleet.ia3.target_modules", options.ia3.target_modules),
    ):
        modules = layer_modules(fused)
        unknown = [t for t in model_targets(targets, fused) if t not in modules]
        if options.method in methods and targets != ["all-linear"] and unknown:
            raise InvalidRequest(
                f"{field} {unknown} are not linear modules of {req.model!r}, whose layers "
                f"have {', '.join(modules)}; target those or ['all-linear']",
                param=field,
            )
    objective = req.objective
    if objective == "dpo" and (problem := dpo_problem(options)):
        raise InvalidRequest(problem[1], param=problem[0])
    settled = settle(
        req.asked_hyperparameters(),
        method=options.method,
        config=config,
        examples=examples,
        workers=options.resources.num_workers,
        objective=objective,
    )
    dpo = None
    if objective == "dpo":
        beta = req.asked_beta()
        dpo = DpoOptions(
            beta=DpoOptions.model_fields["beta"].default if beta == "auto" else beta,
            # the adapter switched off is the model a run starts from, unless it starts
            # from another job's weights
            reference="adapter_disabled"
            if options.method in ADAPTER_REFERENCE_METHODS and options.init_from_job is None
            else "precomputed",
        )
    spec = JobSpec(
        job_id=job_id,
        tenant_id=tenant_id,
        model=req.model,
        training_file=req.training_file,
        validation_file=req.validation_file,
        hyperparameters=settled.hyperparameters,
        base_learning_rate=settled.base_learning_rate,
        seed=req.seed if req.seed is not None else secrets.randbelow(2**31),
        suffix=req.suffix,
        tunefleet=options,
        integrations=tuple(req.integrations or ()),
        objective=objective,
        dpo=dpo,
    )
    return spec, settled


# Methods whose model, with the adapter switched off, is the base (peft's disable_adapter).
ADAPTER_REFERENCE_METHODS = ("lora", "qlora", "ia3")


def dry_run(
    req: JobCreateRequest,
    config: dict[str, Any],
    *,
    tenant_id: str,
    device: PlanDevice,
    examples: int | None = None,
) -> dict[str, Any]:
    """The plan a job of ``req`` would run on ``device`` with a training file of
    ``examples`` (None: not known): the plan of the spec the planner settles, as job
    creation stores it; when the job does not fit (which creation refuses), the plan of the
    spec as asked, whose advice says why and what would fit."""
    spec, _ = build_spec(req, job_id="plan", tenant_id=tenant_id, config=config,
                         examples=examples)  # fmt: skip
    try:
        plan = resolve_spec(
            config, spec, device_bytes=device.memory_bytes, host_bytes=device.host_bytes
        )[1]
    except InvalidRequest as exc:
        if exc.code != "does_not_fit":
            raise
        plan = plan_for_spec(
            config, spec, device_bytes=device.memory_bytes, host_bytes=device.host_bytes
        )
    return {**plan, "chart": chart_of_plan(config, plan)}


def create_job(
    session: Session,
    principal: Principal,
    req: JobCreateRequest,
    registry: ModelRegistry,
    *,
    idempotency_key: str | None = None,
    device: PlanDevice | None = None,
    outbound: OutboundPolicy = PUBLIC_ONLY,
    spaces: TrackingSpaces = TENANT_SPACES,
) -> Row[Any]:
    """Validate references, build the spec and store the job in ``validating_files``
    with its memory plan for ``device``; the stored row (``JOB_COLUMNS``). The addresses
    its integrations name must be ones ``outbound`` (``Settings.outbound_policy``) may
    allow; their names are placed in the tenant's own tracking space (``spaces``).

    Its one write is ``insert_job``, atomic by itself on both databases. Add no other:
    sessions of the hot routes are in autocommit on PostgreSQL, so a second write would be
    its own transaction (``tests/platform/test_new_job.py`` counts them)."""
    registry.require(req.model)
    config = registry.config(req.model)
    options = req.options
    gpus = options.resources.num_workers * options.resources.gpus_per_worker
    if gpus > principal.max_gpus:
        raise QuotaExceeded(
            f"the job asks for {gpus:g} GPUs but tenant {principal.tenant_name!r} may use at "
            f"most {principal.max_gpus}; lower tunefleet.resources or ask an admin to raise "
            "max_gpus",
            param="tunefleet.resources",
        )
    for integration in req.integrations or ():
        if integration.mlflow is not None and integration.mlflow.tracking_uri is not None:
            try:
                outbound.check_url(integration.mlflow.tracking_uri, what="mlflow tracking_uri")
            except OutboundRefused as exc:
                raise InvalidRequest(str(exc), param="integrations") from None
    job_id = new_id("job")
    examples = (
        training_examples(session, principal.tenant_id, req.training_file)
        if req.asks_auto_from_data()
        else None
    )
    spec, settled = build_spec(
        req, job_id=job_id, tenant_id=principal.tenant_id, config=config, examples=examples
    )
    try:
        placed = tuple(spaces.place(i, principal.tenant_name) for i in spec.integrations)
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="integrations") from None
    spec = spec.model_copy(update={"integrations": placed})
    if spec.tunefleet.init_from_job is not None:
        spec = _start_from(session, principal, spec)
    plan = None
    if device is not None:
        spec, plan = resolve_spec(
            config, spec, device_bytes=device.memory_bytes, host_bytes=device.host_bytes
        )
    auto, precision = dict(settled.reasons), ""
    if spec.tunefleet.precision == "auto":
        planned = f"; planned as {plan['input']['precision']}" if plan else ""
        auto["precision"] = AUTO_PRECISION + planned
        precision = f"precision auto ({auto['precision']})"
    now_ns = time.time_ns()
    now = now_ns // 1_000_000_000
    job = NewJob(
        id=job_id,
        tenant_id=principal.tenant_id,
        status=JobStatus.VALIDATING_FILES.value,
        model=req.model,
        training_file=req.training_file,
        validation_file=req.validation_file,
        fine_tuned_model=None,
        spec=spec.model_dump(mode="json"),
        request=req.model_dump(mode="json", exclude_unset=True),
        metadata=req.metadata or {},
        priority=spec.tunefleet.priority,
        attempt=0,
        idempotency_key=idempotency_key,
        created_at=now,
        created_ns=now_ns,
        updated_at=now,
        result_files=[],
        plan=plan,
    )
    event = FirstEvent(
        id=new_id("event"),
        job_id=job_id,
        created_at=now,
        level="info",
        type="message",
        message=f"Created fine-tuning job: {job_id}"
        + "".join(f"; {said}" for said in (settled.describe(), precision) if said),
        data={"auto": auto} if auto else None,
    )
    files = {"training_file": req.training_file}
    if req.validation_file:
        files["validation_file"] = req.validation_file
    stored = insert_job(
        session,
        job,
        event,
        files=files,
        preference=spec.is_dpo,
        waiting_cap=principal.max_waiting_jobs,
    )
    if stored is None:
        for param, file_id in files.items():
            _explain_unusable(session, principal, file_id, param, spec.objective)
        _explain_waiting(session, principal)
        raise AssertionError("unreachable: the job was insertable but not inserted")
    return stored


# The options that shape a method's trained weights: a job starting from another's must
# train the same ones.
_SHAPE_OPTIONS = {"lora": ("lora",), "qlora": ("lora", "qlora"), "ia3": ("ia3",),
                  "adapter": ("adapter",)}  # fmt: skip


def _start_from(session: Session, principal: Principal, spec: JobSpec) -> JobSpec:
    """``spec`` starting from the weights of the tenant's succeeded job that
    ``tunefleet.init_from_job`` names (its id or fine_tuned_model: a trained or an
    imported adapter), with that job's id and, where the request gave none, that job's
    shape options (``tunefleet.lora``...); refused, naming the fix, when that job trained
    another model, method or shape."""
    opts, param = spec.tunefleet, "tunefleet.init_from_job"
    named = opts.init_from_job
    source = session.scalars(
        select(Job).where(
            Job.tenant_id == principal.tenant_id,
            (Job.id == named) | (Job.fine_tuned_model == named),
        )
    ).first()
    if source is None:
        raise NotFound(
            f"no fine-tuning job {named!r} to start from; give the id or fine_tuned_model "
            "of one of your succeeded jobs",
            param=param,
        )
    if source.status != JobStatus.SUCCEEDED.value:
        raise InvalidRequest(
            f"job {source.id} is {source.status}; a job starts only from the weights of a "
            "succeeded job",
            param=param,
        )
    trained = source.spec["tunefleet"]
    if source.model != spec.model:
        raise InvalidRequest(
            f"job {source.id} trained {source.model!r}, not {spec.model!r}: set model to "
            f"{source.model!r}",
            param="model",
        )
    if trained["method"] != opts.method:
        raise InvalidRequest(
            f"job {source.id} trained tunefleet.method {trained['method']!r}; this job's is "
            f"{opts.method!r}: set it to {trained['method']!r} to continue its weights",
            param="tunefleet.method",
        )
    inherited: dict[str, Any] = {}
    for key in _SHAPE_OPTIONS.get(opts.method, ()):
        if key not in opts.model_fields_set and key in trained:  # not asked: the source's
            inherited[key] = type(getattr(opts, key)).model_validate(trained[key])
            continue
        mine = getattr(opts, key).model_dump(mode="json")
        if mine != trained.get(key, mine):
            raise InvalidRequest(
                f"job {source.id} trained with tunefleet.{key} {trained[key]}, and this job "
                f"asks for {mine}: send the same tunefleet.{key} to continue its weights",
                param=f"tunefleet.{key}",
            )
    return spec.model_copy(
        update={"tunefleet": opts.model_copy(update={"init_from_job": source.id, **inherited})}
    )


def get_job(session: Session, principal: Principal, job_id: str) -> Job:
    job = session.get(Job, job_id)
    if job is None or job.tenant_id != principal.tenant_id:
        raise NotFound(f"no fine-tuning job with id {job_id!r}", param="fine_tuning_job_id")
    return job


_REQUEST_FIELDS = frozenset(JobCreateRequest.model_fields)


def job_view(job: Job | Row[Any]) -> dict[str, Any]:
    """The OpenAI ``fine_tuning.job`` object, from a ``Job`` or a row of ``JOB_COLUMNS``.
    Reads the stored spec as JSON (it was validated when the job was made; this runs on
    every read)."""
    spec = job.spec
    hp = dict(spec["hyperparameters"])
    extra = {k: v for k, v in job.request.items() if k not in _REQUEST_FIELDS}
    return {
        "id": job.id,
        "object": "fine_tuning.job",
        "created_at": job.created_at,
        "finished_at": job.finished_at,
        "status": job.status,
        "model": job.model,
        "fine_tuned_model": job.fine_tuned_model,
        "organization_id": job.tenant_id,
        "training_file": job.training_file,
        "validation_file": job.validation_file,
        "hyperparameters": hp,
        "method": _method_view(spec, hp),
        "trained_tokens": job.trained_tokens,
        "estimated_finish": job.estimated_finish,
        "error": job.error,
        "seed": spec["seed"],
        "suffix": spec.get("suffix"),
        "metadata": job.metadata_ or {},  # OpenAI's answer for none given
        "result_files": job.result_files,
        "integrations": job.request.get("integrations") or [],
        "user_provided_suffix": spec.get("suffix"),
        "tunefleet": {
            **spec["tunefleet"],
            "learning_rate": _learning_rate(spec),
            "dpo": spec.get("dpo"),
            "file_stats": job.stats,
            "plan": job.plan,
            "unused_request_fields": extra,
        },
    }


def _method_view(spec: dict[str, Any], hp: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's ``method`` object of a stored spec."""
    if spec.get("objective") == "dpo":
        return {"type": "dpo", "dpo": {"hyperparameters": {**hp, "beta": spec["dpo"]["beta"]}}}
    return {"type": "supervised", "supervised": {"hyperparameters": hp}}


def _learning_rate(spec: dict[str, Any]) -> float:
    """The learning rate a stored spec trains at (``JobSpec.learning_rate``, from JSON)."""
    base = spec.get("base_learning_rate") or BASE_LEARNING_RATE[spec["tunefleet"]["method"]]
    return float(base * spec["hyperparameters"]["learning_rate_multiplier"])


def event_view(event: JobEvent) -> dict[str, Any]:
    """The OpenAI ``fine_tuning.job.event`` object."""
    return {
        "id": event.id,
        "object": "fine_tuning.job.event",
        "created_at": event.created_at,
        "level": event.level,
        "message": event.message,
        "type": event.type,
        "data": event.data,
    }


def list_events(
    session: Session,
    job_id: str,
    *,
    after: str | None = None,
    limit: int = 20,
    level: str | None = None,
    type: str | None = None,
) -> tuple[list[JobEvent], bool]:
    """Events newest first (as OpenAI lists them), ``after`` an event id, optionally of
    one ``level`` or ``type``; returns (events, has_more)."""
    query = select(JobEvent).where(JobEvent.job_id == job_id)
    if level:
        query = query.where(JobEvent.level == level)
    if type:
        query = query.where(JobEvent.type == type)
    if after:
        anchor = session.scalar(
            select(JobEvent.seq).where(JobEvent.id == after, JobEvent.job_id == job_id)
        )
        if anchor is None:
            raise NotFound(f"no event with id {after!r} for job {job_id}", param="after")
        query = query.where(JobEvent.seq < anchor)
    rows = list(session.scalars(query.order_by(JobEvent.seq.desc()).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def check_metadata(v: Any) -> Any:
    """OpenAI's bounds on ``metadata`` (jobs', evals'): at most 16 pairs, keys of at most
    64 characters, values strings of at most 512; the refusal names the key. (Not an
    object: pydantic says so.)"""
    if not isinstance(v, dict):
        return v
    if len(v) > 16:
        extra = ", ".join(repr(str(k)[:20]) for k in list(v)[16:19])
        raise ValueError(
            f"metadata has {len(v)} keys; at most 16 are allowed (remove {extra}"
            f"{', ...' if len(v) > 19 else ''})"
        )
    for key, value in v.items():
        if len(key) > 64:
            raise ValueError(f"metadata key {key[:20]!r}... is {len(key)} characters; at most 64")
        if not isinstance(value, str):
            raise ValueError(
                f"metadata value of {key!r} is {json.dumps(value, default=str)[:40]}, "
                "not a string; values are strings of at most 512 characters"
            )
        if len(value) > 512:
            raise ValueError(f"metadata value of {key!r} is {len(value)} characters; at most 512")
    return v
