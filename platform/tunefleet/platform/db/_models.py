"""SQLAlchemy 2 models: the database is the single source of truth.

Timestamps are integer Unix seconds, as the OpenAI API reports them. Every change to
``Job.status`` goes through ``tunefleet.platform.status.transition``.
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


def now_s() -> int:
    return int(time.time())


class Base(DeclarativeBase):
    """Declarative base of every TuneFleet table."""


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now_s)
    max_concurrent_jobs: Mapped[int] = mapped_column(Integer, default=4)
    max_gpus: Mapped[int] = mapped_column(Integer, default=8)
    # jobs in validating_files or queued at once; creating one more answers 429
    max_waiting_jobs: Mapped[int] = mapped_column(Integer, default=100)
    # inference limits of this tenant; None: the operator's defaults (settings), 0: none
    inference_requests_per_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    inference_concurrent_requests: Mapped[int | None] = mapped_column(Integer, nullable=True)


class ApiKey(Base):
    """A bearer key. Only a SHA-256 of the secret is stored; ``prefix`` identifies it."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(128), default="")
    prefix: Mapped[str] = mapped_column(String(32), unique=True)
    secret_hash: Mapped[str] = mapped_column(String(64))
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now_s)
    revoked_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


class File(Base):
    """An uploaded file; ``path`` is relative to the artifact store root."""

    __tablename__ = "files"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    filename: Mapped[str] = mapped_column(String(512))
    purpose: Mapped[str] = mapped_column(String(32))
    bytes: Mapped[int] = mapped_column(BigInteger)
    status: Mapped[str] = mapped_column(String(16))
    format: Mapped[str | None] = mapped_column(String(32), nullable=True)
    stats: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    path: Mapped[str] = mapped_column(String(1024))
    created_at: Mapped[int] = mapped_column(BigInteger, default=now_s)


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        Index("ix_jobs_tenant_created_ns", "tenant_id", "created_ns"),
        Index("ix_jobs_status", "status"),
        Index("ix_jobs_tenant_status", "tenant_id", "status"),
        Index("uq_jobs_tenant_idempotency", "tenant_id", "idempotency_key", unique=True),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    status: Mapped[str] = mapped_column(String(32))
    model: Mapped[str] = mapped_column(String(256))
    training_file: Mapped[str] = mapped_column(String(64))
    validation_file: Mapped[str | None] = mapped_column(String(64), nullable=True)
    fine_tuned_model: Mapped[str | None] = mapped_column(String(512), nullable=True)
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    request: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    metadata_: Mapped[dict[str, Any]] = mapped_column("metadata", JSON, default=dict)
    error: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    trained_tokens: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    estimated_finish: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    result_files: Mapped[list[Any]] = mapped_column(JSON, default=list)
    stats: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    plan: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    ray_submission_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    idempotency_key: Mapped[str | None] = mapped_column(String(256), nullable=True)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now_s)
    # Nanosecond creation time: a total order for listing and cursors (created_at is
    # whole seconds, as OpenAI reports it, and many jobs share a second).
    created_ns: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    updated_at: Mapped[int] = mapped_column(BigInteger, default=now_s)
    finished_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # The scheduler's bookkeeping: runs that failed (retried with backoff up to a limit),
    # the earliest second a queued job may start again, and where its workers were placed.
    failures: Mapped[int] = mapped_column(Integer, server_default=text("0"), default=0)
    not_before: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    placement: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    # {"run": run id, "seq": n}: that run's records up to n are in (progress.apply).
    reported: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)


class ControllerLease(Base):
    """Leader election: the controller holding the unexpired lease row is the one that
    dispatches. ``term`` grows with every change of holder (a fencing token)."""

    __tablename__ = "controller_leases"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    holder: Mapped[str] = mapped_column(String(128))
    term: Mapped[int] = mapped_column(BigInteger)
    expires_ms: Mapped[int] = mapped_column(BigInteger)


class JobEvent(Base):
    """One line of a job's history; ``seq`` orders events, ``type`` is message or metrics."""

    __tablename__ = "job_events"
    __table_args__ = (Index("ix_job_events_job_seq", "job_id", "seq"),)

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    created_at: Mapped[int] = mapped_column(BigInteger, default=now_s)
    level: Mapped[str] = mapped_column(String(8), default="info")
    type: Mapped[str] = mapped_column(String(16), default="message")
    message: Mapped[str] = mapped_column(Text)
    data: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)


class Checkpoint(Base):
    """A training checkpoint in the artifact store (``path`` relative to its root)."""

    __tablename__ = "checkpoints"
    __table_args__ = (Index("ix_checkpoints_job_step", "job_id", "step"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(String(1024))
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now_s)


class Adapter(Base):
    """A servable fine-tuned model: the adapter a succeeded job produced."""

    __tablename__ = "adapters"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), unique=True)
    name: Mapped[str] = mapped_column(String(512), unique=True)
    base_model: Mapped[str] = mapped_column(String(256))
    path: Mapped[str] = mapped_column(String(1024))
    created_at: Mapped[int] = mapped_column(BigInteger, default=now_s)
    # How replicas serve it: "multiplexed" (batched with other adapters on the shared base)
    # or "merged" (into its own copy of the base); pinned adapters are never evicted.
    serving_mode: Mapped[str] = mapped_column(
        String(16), server_default=text("'multiplexed'"), default="multiplexed"
    )
    pinned: Mapped[bool] = mapped_column(Boolean, server_default=text("false"), default=False)


class AdapterShare(Base):
    """Another tenant that may call an adapter (read-only: it cannot change or share it),
    by name: a share names a tenant whether or not one exists (it takes effect once one
    does), so that sharing does not tell the owner which tenant names exist."""

    __tablename__ = "adapter_shares"

    adapter_id: Mapped[str] = mapped_column(
        ForeignKey("adapters.id", ondelete="CASCADE"), primary_key=True
    )
    tenant_name: Mapped[str] = mapped_column(String(64), primary_key=True, index=True)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now_s)


class InferenceBucket(Base):
    """A tenant's inference rate state (``platform/inference_limits.py``): the theoretical
    arrival time of its next request, in Unix seconds. Its row lock also serialises the
    tenant's admissions."""

    __tablename__ = "inference_buckets"

    tenant_id: Mapped[str] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True
    )
    tat: Mapped[float] = mapped_column(Float)


class InferenceLease(Base):
    """One inference request in flight, until its answer ends or ``expires_at``."""

    __tablename__ = "inference_leases"
    __table_args__ = (Index("ix_inference_leases_tenant", "tenant_id", "expires_at"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    expires_at: Mapped[float] = mapped_column(Float)


class EndedUiSession(Base):
    """A dashboard session signed out before its cookie expires: the SHA-256 of its CSRF
    token (each session's own, in its signed cookie), kept until the cookie would have
    expired, so that a copy of the cookie is refused after sign-out."""

    __tablename__ = "ui_ended_sessions"

    token_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    expires_at: Mapped[int] = mapped_column(BigInteger, index=True)


class WebhookEndpoint(Base):
    """A tenant's URL that receives its jobs' ends (``fine_tuning.job.succeeded`` and so
    on), signed per the Standard Webhooks spec with ``secret`` (``whsec_`` + base64)."""

    __tablename__ = "webhook_endpoints"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    url: Mapped[str] = mapped_column(String(2048))
    secret: Mapped[str] = mapped_column(String(128))
    events: Mapped[list[str]] = mapped_column(JSON)
    description: Mapped[str] = mapped_column(String(256), default="")
    created_at: Mapped[int] = mapped_column(BigInteger, default=now_s)


class Eval(Base):
    """A tenant's eval (``platform/evals.py``): the schema of its items and its testing
    criteria, in OpenAI's shapes as they are shown."""

    __tablename__ = "evals"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(256), default="")
    data_source_config: Mapped[dict[str, Any]] = mapped_column(JSON)
    testing_criteria: Mapped[list[Any]] = mapped_column(JSON)
    metadata_: Mapped[dict[str, Any]] = mapped_column("metadata", JSON, default=dict)
    # nanoseconds: a total order for listing and cursors (shown in seconds)
    created_ns: Mapped[int] = mapped_column(BigInteger)
    updated_ns: Mapped[int] = mapped_column(BigInteger)


class EvalRun(Base):
    """A run of an eval (``platform/evals.py``): its items, the model they are sampled
    from (resolved to a base and an adapter when the run was created), its status and
    counts. The controller (``workers/_evals.py``) runs it."""

    __tablename__ = "eval_runs"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    eval_id: Mapped[str] = mapped_column(ForeignKey("evals.id", ondelete="CASCADE"), index=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(256), default="")
    status: Mapped[str] = mapped_column(String(32), index=True)
    model: Mapped[str] = mapped_column(String(256), default="")  # as the tenant named it
    base_model: Mapped[str] = mapped_column(String(256), default="")  # "": no generation
    adapter_id: Mapped[str] = mapped_column(String(64), default="")  # "": the bare base
    data_source: Mapped[dict[str, Any]] = mapped_column(JSON)  # as shown (no items)
    items: Mapped[list[Any]] = mapped_column(JSON)  # [{"item": ..., "sample"?: ...}]
    metadata_: Mapped[dict[str, Any]] = mapped_column("metadata", JSON, default=dict)
    result_counts: Mapped[dict[str, Any]] = mapped_column(JSON)
    per_testing_criteria_results: Mapped[list[Any]] = mapped_column(JSON)
    per_model_usage: Mapped[list[Any]] = mapped_column(JSON)
    error: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    created_ns: Mapped[int] = mapped_column(BigInteger)
    updated_ns: Mapped[int] = mapped_column(BigInteger)


class EvalOutputItem(Base):
    """One item of a run, sampled and graded: written once (unique per run and item), so a
    run resumed by another controller neither repeats nor loses one."""

    __tablename__ = "eval_output_items"
    __table_args__ = (Index("uq_eval_output_items_run_item", "run_id", "item_index", unique=True),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("eval_runs.id", ondelete="CASCADE"))
    item_index: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16))  # pass, fail, error
    datasource_item: Mapped[dict[str, Any]] = mapped_column(JSON)
    sample: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    results: Mapped[list[Any]] = mapped_column(JSON)
    created_ns: Mapped[int] = mapped_column(BigInteger)


class WebhookDelivery(Base):
    """One event for one endpoint: the outbox row written with the job's status change (in
    its transaction), sent by the controller until the endpoint answers 2xx or the
    attempts run out. ``log`` holds every attempt (time, HTTP status or error)."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        Index("ix_webhook_deliveries_due", "status", "next_attempt_at"),
        Index("ix_webhook_deliveries_endpoint", "endpoint_id", "created_at"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    endpoint_id: Mapped[str] = mapped_column(ForeignKey("webhook_endpoints.id", ondelete="CASCADE"))
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    # the event's id: the payload's ``id`` and the ``webhook-id`` header, the same on every
    # attempt and for every endpoint (receivers deduplicate on it)
    event_id: Mapped[str] = mapped_column(String(64))
    type: Mapped[str] = mapped_column(String(64))
    payload: Mapped[dict[str, Any]] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16), default="pending")
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[int] = mapped_column(BigInteger)
    log: Mapped[list[Any]] = mapped_column(JSON, default=list)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now_s)
    delivered_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


class AuditEntry(Base):
    """One admin or cross-tenant act (``platform.audit``): who did what to which object,
    with the object's values before and after. Written in the act's own transaction, so
    an act is never stored without its entry, nor an entry without its act."""

    __tablename__ = "audit_entries"
    __table_args__ = (
        Index("ix_audit_entries_created", "created_ns"),
        Index("ix_audit_entries_tenant", "tenant_id", "created_ns"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    created_at: Mapped[int] = mapped_column(BigInteger)
    created_ns: Mapped[int] = mapped_column(BigInteger)
    # the key that acted (None: the operator's `tunefleet admin` CLI, on the database)
    actor_key_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    actor_tenant_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    via: Mapped[str] = mapped_column(String(16))  # api, dashboard, cli
    action: Mapped[str] = mapped_column(String(64))
    target_type: Mapped[str] = mapped_column(String(32))
    target_id: Mapped[str] = mapped_column(String(256))
    # the tenant the target belongs to (no foreign key: the record outlives the tenant)
    tenant_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    before: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    after: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
