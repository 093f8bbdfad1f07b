"""``/v1/admin/...``: cross-tenant administration, for admin keys only (403 otherwise)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import select

from tunefleet.api._deps import PrincipalDep, RegistryDep, SessionDep, SettingsDep, StoreDep
from tunefleet.api._openapi import (
    AdapterList,
    AdapterServing,
    AdminJobList,
    AuditList,
    BaseModelList,
    BaseModelObject,
    DeletedBaseModel,
    DeletedWebhookEndpoint,
    NewKey,
    NewTenant,
    NewWebhookEndpoint,
    RevokedKey,
    TenantList,
    TenantObject,
    WebhookDeliveryList,
    WebhookEndpointList,
    errors,
    ok,
)
from tunefleet.platform import audit, tenants, webhooks
from tunefleet.platform.audit import Actor
from tunefleet.platform.base_models import add_base_model, base_model_view, remove_base_model
from tunefleet.platform.db import Adapter, Job, Tenant
from tunefleet.platform.errors import Forbidden, NotFound
from tunefleet.platform.inference_limits import MAX_RATE
from tunefleet.platform.jobs import job_view
from tunefleet.platform.serving import ServingMode, describe, set_serving
from tunefleet.platform.tenants import (
    Principal,
    active_jobs_by_tenant,
    create_key,
    create_tenant,
    get_tenant,
    set_quotas,
)


async def require_admin(principal: PrincipalDep) -> Principal:
    if not principal.is_admin:
        raise Forbidden(
            f"key of tenant {principal.tenant_name!r} is not an admin key; admin routes need "
            "one (`tunefleet admin create-key TENANT --admin`)"
        )
    return principal


AdminDep = Annotated[Principal, Depends(require_admin)]
router = APIRouter(prefix="/v1/admin", tags=["admin"], responses=errors(403))


_RPS = "Inference requests per second; null: the operator's default; 0: no limit."
_CONCURRENT = "Inference requests in flight at once; null: the operator's default; 0: no limit."


class TenantCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(description="1-63 lowercase letters, digits and '-'.")
    max_concurrent_jobs: int = Field(default=4, ge=0, le=10_000)
    max_gpus: int = Field(default=8, ge=0, le=100_000)
    max_waiting_jobs: int = Field(
        default=100, ge=0, le=1_000_000, description="Jobs validating or queued at once."
    )
    inference_requests_per_s: float | None = Field(
        default=None, ge=0, le=MAX_RATE, description=_RPS
    )
    inference_concurrent_requests: int | None = Field(
        default=None, ge=0, le=1_000_000, description=_CONCURRENT
    )


class TenantUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_concurrent_jobs: int | None = Field(default=None, ge=0, le=10_000)
    max_gpus: int | None = Field(default=None, ge=0, le=100_000)
    max_waiting_jobs: int | None = Field(default=None, ge=0, le=1_000_000)
    inference_requests_per_s: float | None = Field(
        default=None, ge=0, le=MAX_RATE, description=_RPS
    )
    inference_concurrent_requests: int | None = Field(
        default=None, ge=0, le=1_000_000, description=_CONCURRENT
    )


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(default="", max_length=128, description="A label for the key.")
    admin: bool = False


def tenant_view(t: Tenant, active_jobs: int = 0) -> dict[str, Any]:
    return {
        "id": t.id,
        "object": "tenant",
        "name": t.name,
        "created_at": t.created_at,
        "max_concurrent_jobs": t.max_concurrent_jobs,
        "max_gpus": t.max_gpus,
        "max_waiting_jobs": t.max_waiting_jobs,
        "inference_requests_per_s": t.inference_requests_per_s,
        "inference_concurrent_requests": t.inference_concurrent_requests,
        "active_jobs": active_jobs,
    }


@router.get("/tenants", responses=ok(TenantList))
def list_tenants(session: SessionDep, _: AdminDep) -> dict[str, Any]:
    active = active_jobs_by_tenant(session)
    rows = session.scalars(select(Tenant).order_by(Tenant.created_at, Tenant.name))
    return {"object": "list", "data": [tenant_view(t, active.get(t.id, 0)) for t in rows]}


@router.post("/tenants", responses={**ok(NewTenant), **errors(409)})
def add_tenant(body: TenantCreate, session: SessionDep, admin: AdminDep) -> dict[str, Any]:
    actor = Actor.of(admin, "api")
    tenant = create_tenant(
        session,
        body.name,
        max_concurrent_jobs=body.max_concurrent_jobs,
        max_gpus=body.max_gpus,
        max_waiting_jobs=body.max_waiting_jobs,
        inference_requests_per_s=body.inference_requests_per_s,
        inference_concurrent_requests=body.inference_concurrent_requests,
        actor=actor,
    )
    key, plaintext = create_key(session, tenant.id, name="initial", actor=actor)
    session.commit()
    return {**tenant_view(tenant), "api_key": plaintext, "key_id": key.id}


@router.patch("/tenants/{tenant_id}", responses={**ok(TenantObject), **errors(404)})
def update_tenant(
    tenant_id: str, body: TenantUpdate, session: SessionDep, admin: AdminDep
) -> dict[str, Any]:
    actor = Actor.of(admin, "api")
    # a limit sent as null goes back to the operator's default; one not sent is unchanged
    tenant = set_quotas(session, tenant_id, actor=actor, **body.model_dump(exclude_unset=True))
    session.commit()
    return tenant_view(tenant)


@router.post("/tenants/{tenant_id}/keys", responses={**ok(NewKey), **errors(404)})
def add_key(
    tenant_id: str, body: KeyCreate, session: SessionDep, admin: AdminDep
) -> dict[str, Any]:
    tenant = get_tenant(session, tenant_id)
    key, plaintext = create_key(
        session, tenant.id, name=body.name, is_admin=body.admin, actor=Actor.of(admin, "api")
    )
    session.commit()
    return {
        "id": key.id,
        "object": "api_key",
        "prefix": key.prefix,
        "tenant_id": tenant.id,
        "admin": key.is_admin,
        "api_key": plaintext,
    }


@router.delete("/keys/{key_id}", responses={**ok(RevokedKey), **errors(404)})
def revoke_key(key_id: str, session: SessionDep, admin: AdminDep) -> dict[str, Any]:
    key = tenants.revoke_key(session, key_id, actor=Actor.of(admin, "api"))
    session.commit()
    return {"id": key.id, "object": "api_key", "prefix": key.prefix, "revoked": True}


@router.get("/jobs", responses=ok(AdminJobList))
def all_jobs(
    session: SessionDep,
    _: AdminDep,
    status: str | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> dict[str, Any]:
    query = select(Job).order_by(Job.created_ns.desc(), Job.id.desc()).limit(limit)
    if status:
        query = query.where(Job.status == status)
    return {
        "object": "list",
        "data": [{**job_view(j), "tenant_id": j.tenant_id} for j in session.scalars(query)],
    }


class ServingUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    serving_mode: ServingMode | None = Field(
        default=None,
        description="'merged': into its own copy of the base (no LoRA overhead, one base's "
        "memory more per replica); 'multiplexed': batched with other adapters on the "
        "shared base.",
    )
    pinned: bool | None = Field(default=None, description="Never evicted from replicas.")


@router.get("/adapters", responses=ok(AdapterList))
def all_adapters(session: SessionDep, _: AdminDep, base_model: str | None = None) -> dict[str, Any]:
    """Every tenant's adapters with how they are served."""
    query = select(Adapter).order_by(Adapter.created_at, Adapter.id)
    if base_model:
        query = query.where(Adapter.base_model == base_model)
    return {
        "object": "list",
        "data": [{**describe(a), "tenant_id": a.tenant_id} for a in session.scalars(query)],
    }


@router.patch("/adapters/{model:path}", responses={**ok(AdapterServing), **errors(404)})
def update_serving(
    model: str, body: ServingUpdate, session: SessionDep, admin: AdminDep
) -> dict[str, Any]:
    """Move an adapter between merged and multiplexed serving, or pin it; every replica of
    its base model applies the change once the controller pushes it (within
    ``TUNEFLEET_SERVE_CONFIG_PUSH_S``), requests in flight finish where they started."""
    adapter = set_serving(
        session, model, mode=body.serving_mode, pinned=body.pinned, actor=Actor.of(admin, "api")
    )
    session.commit()
    return {**describe(adapter), "tenant_id": adapter.tenant_id}


class WebhookCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str = Field(max_length=webhooks.MAX_URL, description="An http(s) URL.")
    events: list[str] | None = Field(
        default=None,
        max_length=len(webhooks.EVENTS),
        description=f"Which of {', '.join(webhooks.EVENTS)}; all when left out.",
    )
    description: str = Field(default="", max_length=256)


@router.post("/tenants/{tenant_id}/webhooks", responses={**ok(NewWebhookEndpoint), **errors(404)})
def add_webhook(
    tenant_id: str,
    body: WebhookCreate,
    session: SessionDep,
    settings: SettingsDep,
    admin: AdminDep,
) -> dict[str, Any]:
    """A webhook endpoint for the tenant's jobs' ends, signed per Standard Webhooks; its
    secret is in this answer only. Its URL must be public, or allowed by the operator
    (``TUNEFLEET_OUTBOUND_ALLOW``)."""
    tenant = get_tenant(session, tenant_id)
    endpoint = webhooks.add_endpoint(
        session,
        tenant.id,
        body.url,
        events=body.events,
        description=body.description,
        policy=settings.outbound_policy,
        actor=Actor.of(admin, "api"),
    )
    session.commit()
    return webhooks.endpoint_view(endpoint, with_secret=True)


@router.get("/tenants/{tenant_id}/webhooks", responses={**ok(WebhookEndpointList), **errors(404)})
def list_webhooks(tenant_id: str, session: SessionDep, _: AdminDep) -> dict[str, Any]:
    tenant = get_tenant(session, tenant_id)
    found = webhooks.list_endpoints(session, tenant.id)
    return {"object": "list", "data": [webhooks.endpoint_view(e) for e in found]}


@router.delete("/webhooks/{endpoint_id}", responses={**ok(DeletedWebhookEndpoint), **errors(404)})
def remove_webhook(endpoint_id: str, session: SessionDep, admin: AdminDep) -> dict[str, Any]:
    """Remove the endpoint and its deliveries, sent or not."""
    endpoint = webhooks.remove_endpoint(session, endpoint_id, actor=Actor.of(admin, "api"))
    session.commit()
    return {"id": endpoint.id, "object": "webhook_endpoint", "deleted": True}


@router.get(
    "/webhooks/{endpoint_id}/deliveries", responses={**ok(WebhookDeliveryList), **errors(404)}
)
def webhook_deliveries(
    endpoint_id: str,
    session: SessionDep,
    _: AdminDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 50,
) -> dict[str, Any]:
    """The endpoint's delivery log, newest first: each event, its status and attempts."""
    found = webhooks.deliveries(session, endpoint_id, limit)
    return {"object": "list", "data": [webhooks.delivery_view(d) for d in found]}


@router.get("/audit", responses=ok(AuditList))
def audit_log(
    session: SessionDep,
    _: AdminDep,
    tenant_id: str | None = None,
    action: str | None = None,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> dict[str, Any]:
    """Admin and cross-tenant acts, newest first: who (the key, its tenant, through the API,
    the dashboard or the CLI), what, on which object of which tenant, before and after.
    ``after`` is the last id of the previous page."""
    found, more = audit.entries(
        session, limit=limit, after=after, tenant_id=tenant_id, action=action
    )
    data = [audit.entry_view(e) for e in found]
    return {
        "object": "list",
        "data": data,
        "has_more": more,
        "last_id": data[-1]["id"] if data else None,
    }


class BaseModelCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=128, description="The model's name in the registry and in jobs.")
    source: str = Field(
        max_length=2048,
        description="An s3:// folder in the artifact store, or a folder inside "
        "TUNEFLEET_MODEL_IMPORT_DIR, as transformers' save_pretrained writes one.",
    )
    chat_template: str | None = Field(
        default=None,
        max_length=1 << 20,
        description="A Jinja chat template, for a model whose folder has none.",
    )


@router.get("/base_models", responses=ok(BaseModelList))
def list_base_models(_: AdminDep, registry: RegistryDep) -> dict[str, Any]:
    """The registry's base models, each with what its folder holds (architecture,
    parameters, weights) or the problem a folder placed by hand has."""
    return {"object": "list", "data": [base_model_view(registry, n) for n in registry.names()]}


@router.post("/base_models", responses={**ok(BaseModelObject), **errors(409)})
def create_base_model(
    body: BaseModelCreate,
    session: SessionDep,
    admin: AdminDep,
    registry: RegistryDep,
    store: StoreDep,
    settings: SettingsDep,
) -> dict[str, Any]:
    """Check a model (config and weights agree, a supported architecture, a tokenizer and
    a chat template) and copy it into the registry; jobs may name it once this answers."""
    view = add_base_model(
        session,
        registry,
        store,
        body.name,
        body.source,
        actor=Actor.of(admin, "api"),
        chat_template=body.chat_template,
        import_dir=settings.model_import_dir,
    )
    session.commit()
    return view


@router.get("/base_models/{name}", responses={**ok(BaseModelObject), **errors(404)})
def get_base_model(name: str, _: AdminDep, registry: RegistryDep) -> dict[str, Any]:
    if name not in registry.names():
        raise NotFound(f"no base model {name!r} in the registry", param="name")
    return base_model_view(registry, name)


@router.delete("/base_models/{name}", responses={**ok(DeletedBaseModel), **errors(404, 409)})
def delete_base_model(
    name: str, session: SessionDep, admin: AdminDep, registry: RegistryDep
) -> dict[str, Any]:
    """Remove a model no unfinished job and no adapter uses (409 naming them otherwise)."""
    gone = remove_base_model(session, registry, name, actor=Actor.of(admin, "api"))
    session.commit()
    return gone
