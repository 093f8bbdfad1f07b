"""How adapters are served, as the database records it (the contract between the API and
the Serve applications is ``serving_contract``'s).

The controller pushes :func:`serving_config` of each base model to its replicas, which
apply it (merged copies built or dropped, adapters pinned or released), so a change made
through the API reaches every replica, including ones autoscaling starts later, without a
restart; replicas never read the database.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal, get_args

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from tunefleet.platform import audit
from tunefleet.platform.audit import Actor
from tunefleet.platform.db import Adapter, AdapterShare, Checkpoint, Job, Tenant
from tunefleet.platform.errors import InvalidRequest, NotFound
from tunefleet.platform.serving_contract import checkpoint_adapter_id
from tunefleet.platform.spec import fine_tuned_model_name
from tunefleet.platform.tenants import check_tenant_name

ServingMode = Literal["multiplexed", "merged"]


# The newest adapters of a base model that every replica's node keeps on local disk, so
# that the first request for one does not wait for object storage.
PREFETCH_ADAPTERS = 64


def serving_config(session: Session, base_model: str) -> dict[str, list[str]]:
    """``{"merged": [...], "pinned": [...], "prefetch": [...]}`` of one base model: adapter
    ids (the job that made each, its artifact key) served merged, kept loaded, and copied
    ahead of any request into each replica's node cache (the newest PREFETCH_ADAPTERS)."""
    prefetch = list(
        session.scalars(
            select(Adapter.job_id)
            .where(Adapter.base_model == base_model)
            .order_by(Adapter.created_at.desc(), Adapter.job_id)
            .limit(PREFETCH_ADAPTERS)
        )
    )
    rows = session.execute(
        select(Adapter.job_id, Adapter.serving_mode, Adapter.pinned)
        .where(
            Adapter.base_model == base_model,
            or_(Adapter.serving_mode == "merged", Adapter.pinned.is_(True)),
        )
        .order_by(Adapter.job_id)
    )
    merged, pinned = [], []
    for job_id, mode, pin in rows:
        if mode == "merged":
            merged.append(job_id)
        if pin:
            pinned.append(job_id)
    return {"merged": merged, "pinned": pinned, "prefetch": prefetch}


def describe(adapter: Adapter) -> dict[str, object]:
    return {
        "model": adapter.name,
        "base_model": adapter.base_model,
        "serving_mode": adapter.serving_mode,
        "pinned": adapter.pinned,
    }


def set_serving(
    session: Session,
    name: str,
    *,
    mode: str | None = None,
    pinned: bool | None = None,
    actor: Actor | None = None,
) -> Adapter:
    """Move adapter ``name`` between merged and multiplexed serving, or pin it (an admin's
    call: every tenant's adapters share the replicas). Replicas apply it when the
    controller next pushes their config. Recorded as ``actor``'s act when given."""
    adapter = session.scalar(select(Adapter).where(Adapter.name == name))
    if adapter is None:
        raise NotFound(f"no fine-tuned model named {name!r}", param="model")
    before = {"serving_mode": adapter.serving_mode, "pinned": adapter.pinned}
    if mode is not None:
        if mode not in get_args(ServingMode):
            raise InvalidRequest(
                f"serving mode {mode!r} is not one of {', '.join(get_args(ServingMode))}",
                param="serving_mode",
            )
        adapter.serving_mode = mode
    if pinned is not None:
        adapter.pinned = pinned
    session.flush()
    if actor is not None:
        audit.record(
            session,
            actor,
            "adapter.serving",
            target_type="model",
            target_id=name,
            tenant_id=adapter.tenant_id,
            before=before,
            after={"serving_mode": adapter.serving_mode, "pinned": adapter.pinned},
        )
    return adapter


def _shared_with(tenant_id: str) -> Any:
    return (
        select(AdapterShare.adapter_id)
        .join(Tenant, Tenant.name == AdapterShare.tenant_name)
        .where(Tenant.id == tenant_id)
    )


def visible_adapter(session: Session, tenant_id: str, name: str) -> Adapter | None:
    """The adapter called ``name`` if the tenant owns it or it is shared with the tenant."""
    return session.scalar(
        select(Adapter).where(
            Adapter.name == name,
            or_(Adapter.tenant_id == tenant_id, Adapter.id.in_(_shared_with(tenant_id))),
        )
    )


# OpenAI's name of a job's checkpoint as a model: the job's model name, then the step.
CHECKPOINT_MODEL = re.compile(r"(?P<model>ft:.+:(?P<job>[^:]+)):ckpt-step-(?P<step>[0-9]{1,9})")


def checkpoint_model_name(job: Job, tenant_name: str, step: int) -> str:
    model = fine_tuned_model_name(job.model, tenant_name, job.spec.get("suffix"), job.id)
    return f"{model}:ckpt-step-{step}"


@dataclass(frozen=True)
class ServedCheckpoint:
    base_model: str
    adapter_id: str  # what Serve loads (``serving_contract.adapter_weights_key``)
    path: str  # its folder in the artifact store


def visible_checkpoint(session: Session, tenant_id: str, name: str) -> ServedCheckpoint | None:
    """The checkpoint a ``...:ckpt-step-N`` model name stands for, if the tenant may call
    it: one of its own jobs' (sharing a model shares that model, not how it was made)."""
    matched = CHECKPOINT_MODEL.fullmatch(name)
    if matched is None:
        return None
    job = session.get(Job, matched["job"])
    owner = session.get(Tenant, job.tenant_id) if job is not None else None
    if job is None or owner is None:
        return None
    step = int(matched["step"])
    if job.tenant_id != tenant_id or checkpoint_model_name(job, owner.name, step) != name:
        return None
    checkpoint = session.scalar(
        select(Checkpoint).where(Checkpoint.job_id == job.id, Checkpoint.step == step)
    )
    if checkpoint is None:
        return None
    return ServedCheckpoint(job.model, checkpoint_adapter_id(job.id, step), checkpoint.path)


def visible_adapters(session: Session, tenant_id: str) -> list[tuple[Adapter, str]]:
    """(adapter, owner tenant name) of every adapter the tenant owns or may call."""
    rows = session.execute(
        select(Adapter, Tenant.name)
        .join(Tenant, Tenant.id == Adapter.tenant_id)
        .where(or_(Adapter.tenant_id == tenant_id, Adapter.id.in_(_shared_with(tenant_id))))
        .order_by(Adapter.created_at, Adapter.id)
    )
    return [(a, name) for a, name in rows]


def owned_adapter(session: Session, tenant_id: str, name: str) -> Adapter:
    adapter = session.scalar(
        select(Adapter).where(Adapter.name == name, Adapter.tenant_id == tenant_id)
    )
    if adapter is None:
        raise NotFound(
            f"no model named {name!r} of yours; list yours with GET /v1/models",
            param="model",
            code="model_not_found",
        )
    return adapter


def shares(session: Session, adapter: Adapter) -> list[str]:
    """Names of the tenants an adapter is shared with (whether or not they exist)."""
    return list(
        session.scalars(
            select(AdapterShare.tenant_name)
            .where(AdapterShare.adapter_id == adapter.id)
            .order_by(AdapterShare.tenant_name)
        )
    )


def share(session: Session, adapter: Adapter, tenant_name: str) -> None:
    """Let tenant ``tenant_name`` call ``adapter`` (idempotent). The share is kept whether
    or not such a tenant exists, and takes effect when one does: the answer is the same
    either way, so an owner cannot probe which tenant names exist."""
    check_tenant_name(tenant_name, param="tenant")
    owner = session.scalar(select(Tenant.name).where(Tenant.id == adapter.tenant_id))
    if tenant_name == owner:
        raise InvalidRequest("an adapter is always visible to its own tenant", param="tenant")
    if session.get(AdapterShare, (adapter.id, tenant_name)) is None:
        session.add(AdapterShare(adapter_id=adapter.id, tenant_name=tenant_name))
        session.flush()


def unshare(session: Session, adapter: Adapter, tenant_name: str) -> None:
    row = session.get(AdapterShare, (adapter.id, tenant_name))
    if row is None:
        raise NotFound(
            f"model {adapter.name!r} is not shared with a tenant named {tenant_name!r}",
            param="tenant",
        )
    session.delete(row)
    session.flush()
