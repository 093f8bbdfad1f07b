"""What the OpenAPI document (``/openapi.json``) says each route answers.

The handlers build plain dicts (validating each answer against a model would cost more
than the busiest routes' own work), so these models document the shapes without checking
them at run time; ``tests/api/test_fuzz.py`` checks that the answers keep to them, and to
the error statuses each route declares with ``errors(...)``. Validation errors are 400
here (``errors.py``), so FastAPI's default 422 entries are dropped from the document.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field

from tunefleet.api._errors import NOT_RETRYABLE
from tunefleet.platform.status import JobStatus


class ErrorDetail(BaseModel):
    message: str = Field(description="What was wrong, quoting the value, and what to do.")
    type: str = Field(description="OpenAI's error type, e.g. invalid_request_error.")
    param: str | None = Field(description="The request field at fault, if one is.")
    code: str | None = Field(description="A stable code, e.g. not_found, file_too_large.")


class ErrorResponse(BaseModel):
    """OpenAI's error shape."""

    error: ErrorDetail


_ERRORS: dict[int, str] = {
    400: "Invalid request: the body, a parameter or an uploaded file; `param` names it.",
    401: "Missing, unknown or revoked API key.",
    403: "Not permitted: an admin route without an admin key, or deleting a base model.",
    404: "No such object, or not the caller's.",
    409: "The object's state does not allow it (e.g. cancelling a finished job).",
    413: "The body is over its limit (TUNEFLEET_MAX_UPLOAD_BYTES, "
    "TUNEFLEET_MAX_JSON_BODY_BYTES or TUNEFLEET_MAX_INFERENCE_BODY_BYTES).",
    429: "Over the tenant's quota.",
    503: "A dependency is unavailable: the database (with Retry-After), or serving.",
}
_RETRY_AFTER = {
    "Retry-After": {
        "description": "Seconds to wait before retrying (database unavailable).",
        "schema": {"type": "string"},
    }
}
_NO_RETRY = {
    "x-should-retry": {
        "description": "`false`: retrying the same request cannot succeed (the OpenAI SDKs "
        "obey it rather than retrying 409 and 429).",
        "schema": {"type": "string", "enum": ["false"]},
    }
}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` entries for the errors a route answers of its own (404, 409, ...);
    those every route shares are added by ``openapi_document``."""
    out: dict[int | str, dict[str, Any]] = {}
    for code in codes:
        out[code] = {"model": ErrorResponse, "description": _ERRORS[code]}
        if code == 503:
            out[code]["headers"] = _RETRY_AFTER
        if code in NOT_RETRYABLE:
            out[code]["headers"] = _NO_RETRY
    return out


def rate_limited() -> dict[int | str, dict[str, Any]]:
    """The ``responses=`` entry of a route under the tenant's inference limits: a 429 a
    client should retry after the wait it names."""
    wait = {"schema": {"type": "string"}}
    return {
        429: {
            "model": ErrorResponse,
            "description": "Over the tenant's inference requests per second or requests in "
            "flight (type `requests`, code `rate_limit_exceeded`); retry after the wait.",
            "headers": {
                "Retry-After": {"description": "Whole seconds to wait.", **wait},
                "retry-after-ms": {"description": "Milliseconds to wait.", **wait},
            },
        }
    }


def _shared_errors(method: str, path: str, operation: dict[str, Any]) -> list[int]:
    """What any operation answers, by what it takes: a key (401 for a bad one; 503 when
    the database, which the key is checked in, is away), parameters or a body (400), a
    body read under /v1/ (413, body_limits.py)."""
    codes = []
    if operation.get("security"):
        codes += [401, 503]
    if operation.get("parameters") or operation.get("requestBody"):
        codes.append(400)
    if method.upper() in ("POST", "PUT", "PATCH") and path.startswith("/v1/"):
        codes.append(413)
    return codes


def ok(model: type[BaseModel] | dict[str, Any], description: str = "OK") -> dict[int | str, Any]:
    """The documented 200 answer: a model, or a raw OpenAPI response object."""
    if isinstance(model, dict):
        return {200: {"description": description, **model}}
    return {200: {"model": model, "description": description}}


# Success shapes. Open to fields added later (clients must ignore unknown ones).


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class FileObject(_Open):
    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str
    status_details: str | None
    tunefleet: dict[str, Any] = Field(description="`format` and `stats` of the file.")


class FileList(_Open):
    object: Literal["list"]
    data: list[FileObject]
    has_more: bool


class Deleted(_Open):
    id: str
    object: str
    deleted: bool


class Hyperparameters(_Open):
    n_epochs: int
    batch_size: int
    learning_rate_multiplier: float


class JobObject(_Open):
    id: str
    object: Literal["fine_tuning.job"]
    created_at: int
    finished_at: int | None
    status: JobStatus
    model: str
    fine_tuned_model: str | None
    organization_id: str
    training_file: str
    validation_file: str | None
    hyperparameters: Hyperparameters
    method: dict[str, Any]
    trained_tokens: int | None
    estimated_finish: int | None
    error: dict[str, Any] | None
    seed: int
    suffix: str | None
    metadata: dict[str, str]
    result_files: list[Any]
    integrations: list[Any]
    user_provided_suffix: str | None
    tunefleet: dict[str, Any] = Field(
        description="The job's TuneFleet options as settled, file_stats, plan and "
        "unused_request_fields."
    )


class JobList(_Open):
    object: Literal["list"]
    data: list[JobObject]
    has_more: bool


class EventObject(_Open):
    id: str
    object: Literal["fine_tuning.job.event"]
    created_at: int
    level: Literal["info", "warn", "error"]
    message: str
    type: Literal["message", "metrics"]
    data: dict[str, Any] | None


class EventList(_Open):
    object: Literal["list"]
    data: list[EventObject]
    has_more: bool


class CheckpointObject(_Open):
    id: str
    object: Literal["fine_tuning.job.checkpoint"]
    created_at: int
    fine_tuning_job_id: str
    fine_tuned_model_checkpoint: str
    step_number: int
    metrics: dict[str, Any]


class CheckpointList(_Open):
    object: Literal["list"]
    data: list[CheckpointObject]
    has_more: bool


class ModelObject(_Open):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    parent: str | None


class ModelList(_Open):
    object: Literal["list"]
    data: list[ModelObject]


class Shares(_Open):
    object: Literal["list"]
    model: str
    data: list[str] = Field(description="Names of the tenants the model is shared with.")


class Plan(_Open):
    object: Literal["fine_tuning.plan"]
    model: str
    parameters: dict[str, Any]
    input: dict[str, Any]
    breakdown: dict[str, Any]
    device: dict[str, Any]
    advice: dict[str, Any]
    chart: list[dict[str, Any]] = Field(
        description="The seeds' chart (DDP, + gradient checkpointing, ZeRO-3, + CPU offload) "
        "at the job's per-device batch: each step's breakdown and whether it fits."
    )


class TenantObject(_Open):
    id: str
    object: Literal["tenant"]
    name: str
    created_at: int
    max_concurrent_jobs: int
    max_gpus: int
    active_jobs: int


class TenantList(_Open):
    object: Literal["list"]
    data: list[TenantObject]


class NewTenant(TenantObject):
    api_key: str = Field(description="The tenant's first key; shown once.")
    key_id: str


class NewKey(_Open):
    id: str
    object: Literal["api_key"]
    prefix: str
    tenant_id: str
    admin: bool
    api_key: str = Field(description="Shown once.")


class RevokedKey(_Open):
    id: str
    object: Literal["api_key"]
    prefix: str
    revoked: bool


class BaseModelObject(_Open):
    id: str
    object: Literal["base_model"]
    created: int
    architecture: str | None = None
    model_type: str | None = None
    parameters: int | None = None
    weight_bytes: int | None = None
    shards: int | None = None
    dtypes: list[str] | None = None
    context_length: int | None = None
    problem: str | None = Field(
        description="Why the folder would be refused on add (placed by hand); null: none."
    )


class BaseModelList(_Open):
    object: Literal["list"]
    data: list[BaseModelObject]


class DeletedBaseModel(_Open):
    id: str
    object: Literal["base_model"]
    deleted: bool


class AdminJobList(_Open):
    object: Literal["list"]
    data: list[JobObject]


class AdapterServing(_Open):
    model: str
    base_model: str
    serving_mode: Literal["multiplexed", "merged"]
    pinned: bool
    tenant_id: str


class AdapterList(_Open):
    object: Literal["list"]
    data: list[AdapterServing]


class WebhookEndpointObject(_Open):
    id: str
    object: Literal["webhook_endpoint"]
    tenant_id: str
    url: str
    events: list[str]
    description: str
    created_at: int


class NewWebhookEndpoint(WebhookEndpointObject):
    secret: str = Field(
        description="The signing secret (Standard Webhooks, `whsec_...`); shown once."
    )


class DeletedWebhookEndpoint(_Open):
    id: str
    object: Literal["webhook_endpoint"]
    deleted: bool


class AuditActor(_Open):
    key_id: str | None = Field(description="The key that acted; null for the operator's CLI.")
    tenant_id: str | None
    via: Literal["api", "dashboard", "cli"]


class AuditTarget(_Open):
    type: str
    id: str
    tenant_id: str | None = Field(description="The tenant the object belongs to.")


class AuditEntryObject(_Open):
    id: str
    object: Literal["audit_entry"]
    created_at: int
    actor: AuditActor
    action: str = Field(description="e.g. tenant.quotas, key.revoke, job.pause")
    target: AuditTarget
    before: dict[str, Any] | None
    after: dict[str, Any] | None


class AuditList(_Open):
    object: Literal["list"]
    data: list[AuditEntryObject]
    has_more: bool
    last_id: str | None


class EvalObject(_Open):
    id: str
    object: Literal["eval"]
    name: str
    created_at: int
    metadata: dict[str, str]
    data_source_config: dict[str, Any]
    testing_criteria: list[dict[str, Any]]


class EvalList(_Open):
    object: Literal["list"]
    data: list[EvalObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class EvalDeleted(_Open):
    object: Literal["eval.deleted"]
    deleted: bool
    eval_id: str


class EvalRunObject(_Open):
    id: str
    object: Literal["eval.run"]
    eval_id: str
    name: str
    status: Literal["queued", "in_progress", "completed", "canceled", "failed"]
    model: str
    created_at: int
    data_source: dict[str, Any]
    metadata: dict[str, str]
    result_counts: dict[str, int]
    per_testing_criteria_results: list[dict[str, Any]]
    per_model_usage: list[dict[str, Any]]
    error: dict[str, Any] | None
    report_url: str


class EvalRunList(_Open):
    object: Literal["list"]
    data: list[EvalRunObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class EvalRunDeleted(_Open):
    object: Literal["eval.run.deleted"]
    deleted: bool
    run_id: str


class OutputItemObject(_Open):
    id: str
    object: Literal["eval.run.output_item"]
    run_id: str
    eval_id: str
    created_at: int
    status: Literal["pass", "fail", "error"]
    datasource_item_id: int
    datasource_item: dict[str, Any]
    results: list[dict[str, Any]]
    sample: dict[str, Any] | None


class OutputItemList(_Open):
    object: Literal["list"]
    data: list[OutputItemObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class WebhookEndpointList(_Open):
    object: Literal["list"]
    data: list[WebhookEndpointObject]


class WebhookAttempt(_Open):
    at: int
    status_code: int | None
    ms: int
    error: str | None = None


class WebhookDeliveryObject(_Open):
    id: str
    object: Literal["webhook_delivery"]
    endpoint_id: str
    event_id: str
    type: str
    job_id: str
    status: Literal["pending", "delivered", "failed"]
    attempts: int
    next_attempt_at: int | None
    created_at: int
    delivered_at: int | None
    log: list[WebhookAttempt]


class WebhookDeliveryList(_Open):
    object: Literal["list"]
    data: list[WebhookDeliveryObject]


class Health(_Open):
    status: Literal["ok"]


class Readiness(_Open):
    status: Literal["ready", "not ready"]
    database: str  # "ok", or why not
    ray: str


def openapi_document(app: FastAPI) -> dict[str, Any]:
    """The app's OpenAPI document, built once: every operation with the errors it shares
    with others (``_shared_errors``), and without FastAPI's 422 answers (TuneFleet
    refuses an invalid request with 400)."""
    if app.openapi_schema:
        return app.openapi_schema
    doc = get_openapi(
        title=app.title,
        version=app.version,
        description=app.description,
        routes=app.routes,
    )
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    error_schema = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(error_schema.pop("$defs", {}))
    schemas["ErrorResponse"] = error_schema
    for path, operations in doc.get("paths", {}).items():
        for method, operation in operations.items():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            for code in _shared_errors(method, path, operation):
                entry = responses.setdefault(str(code), {"description": _ERRORS[code]})
                entry.setdefault(
                    "content",
                    {
                        "application/json": {
                            "schema": {"$ref": "#/components/schemas/ErrorResponse"}
                        }
                    },
                )
                if code == 503:
                    entry.setdefault("headers", _RETRY_AFTER)
    app.openapi_schema = doc
    return doc
