"""``/v1/models``: the base models in the registry, the caller's fine-tuned models and the
ones other tenants shared with it; importing an adapter trained elsewhere (TuneFleet's
``POST``); sharing an adapter with another tenant; deleting one."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import delete

from tunefleet.api._deps import PrincipalDep, RegistryDep, SessionDep, SettingsDep, StoreDep
from tunefleet.api._openapi import Deleted, ModelList, ModelObject, Shares, errors, ok
from tunefleet.platform.adapter_import import import_adapter
from tunefleet.platform.db import Adapter, Tenant
from tunefleet.platform.errors import Forbidden, NotFound
from tunefleet.platform.models import ModelRegistry
from tunefleet.platform.serving import (
    owned_adapter,
    share,
    shares,
    unshare,
    visible_adapter,
    visible_adapters,
)

router = APIRouter(prefix="/v1/models", tags=["models"])


class ShareCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenant: str = Field(description="Name of the tenant that may call the model.")


def _base(registry: ModelRegistry, name: str) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": registry.created(name),
        "owned_by": "tunefleet",
        "parent": None,
    }


def _adapter(a: Adapter, owner: str) -> dict[str, Any]:
    return {
        "id": a.name,
        "object": "model",
        "created": a.created_at,
        "owned_by": owner,
        "parent": a.base_model,
    }


class AdapterImport(BaseModel):
    model_config = ConfigDict(extra="forbid")
    base_model: str = Field(max_length=256, description="The registry model it adapts.")
    name: str = Field(max_length=64, description="Its part of the model's name.")
    file_id: str | None = Field(
        default=None, max_length=64, description="An upload of purpose adapter (.tar/.zip)."
    )
    source: str | None = Field(
        default=None,
        max_length=1024,
        description="Or its folder in object storage, under the store's imports/{tenant}/.",
    )


def _shares_view(session: SessionDep, adapter: Adapter) -> dict[str, Any]:
    return {"object": "list", "model": adapter.name, "data": shares(session, adapter)}


@router.post("", responses={**ok(ModelObject), **errors(404, 409)})
def import_model(
    body: AdapterImport,
    session: SessionDep,
    principal: PrincipalDep,
    registry: RegistryDep,
    store: StoreDep,
    settings: SettingsDep,
) -> dict[str, Any]:
    """Import a peft LoRA adapter trained elsewhere as one of the caller's fine-tuned
    models (``ft:BASE:TENANT:NAME:adapter-...``), checked against its base first: targets
    among the base's linear layers, every factor's shape, the rank within
    ``TUNEFLEET_ADAPTER_MAX_RANK``, safetensors only. It is served, shared, deleted and
    trained further (``tunefleet.init_from_job``) like a model TuneFleet trained; the job
    that records the import is ``tunefleet.job_id``."""
    job, adapter = import_adapter(
        session,
        principal,
        registry,
        store,
        base_model=body.base_model,
        name=body.name,
        file_id=body.file_id,
        source=body.source,
        max_rank=settings.adapter_max_rank,
        max_bytes=settings.max_upload_bytes,
    )
    imported = job.request["tunefleet"]["imported_from"]
    return {**_adapter(adapter, principal.tenant_name), "tunefleet": {"job_id": job.id, **imported}}


@router.get("", responses=ok(ModelList))
async def list_models(
    session: SessionDep, principal: PrincipalDep, registry: RegistryDep
) -> dict[str, Any]:
    data = [_base(registry, n) for n in registry.names()]
    data += [_adapter(a, owner) for a, owner in visible_adapters(session, principal.tenant_id)]
    return {"object": "list", "data": data}


@router.get("/{model:path}/shares", responses={**ok(Shares), **errors(404)})
async def list_shares(model: str, session: SessionDep, principal: PrincipalDep) -> dict[str, Any]:
    """Tenants the caller's model is shared with."""
    return _shares_view(session, owned_adapter(session, principal.tenant_id, model))


@router.post("/{model:path}/shares", responses={**ok(Shares), **errors(404)})
async def create_share(
    model: str, body: ShareCreate, session: SessionDep, principal: PrincipalDep
) -> dict[str, Any]:
    """Let another tenant call the caller's model (it cannot change or re-share it)."""
    adapter = owned_adapter(session, principal.tenant_id, model)
    share(session, adapter, body.tenant)
    session.commit()
    return _shares_view(session, adapter)


@router.delete("/{model:path}/shares/{tenant}", responses={**ok(Shares), **errors(404)})
async def delete_share(
    model: str, tenant: str, session: SessionDep, principal: PrincipalDep
) -> dict[str, Any]:
    adapter = owned_adapter(session, principal.tenant_id, model)
    unshare(session, adapter, tenant)
    session.commit()
    return _shares_view(session, adapter)


@router.get("/{model:path}", responses={**ok(ModelObject), **errors(404)})
async def retrieve_model(
    model: str, session: SessionDep, principal: PrincipalDep, registry: RegistryDep
) -> dict[str, Any]:
    if model in registry.names():
        return _base(registry, model)
    adapter = visible_adapter(session, principal.tenant_id, model)
    if adapter is None:
        raise NotFound(
            f"no model named {model!r}; list yours with GET /v1/models",
            param="model",
            code="model_not_found",
        )
    owner = session.get(Tenant, adapter.tenant_id)
    return _adapter(adapter, owner.name if owner else "")


# After the /shares routes: ``{model:path}`` would take "NAME/shares/TENANT" too.
@router.delete("/{model:path}", responses={**ok(Deleted), **errors(403, 404)})
def delete_model(
    model: str,
    session: SessionDep,
    principal: PrincipalDep,
    registry: RegistryDep,
    store: StoreDep,
) -> dict[str, Any]:
    """Delete one of the caller's fine-tuned models: its adapter record (and its shares)
    and its weights in the artifact store, so replicas stop serving it; the job that made
    it keeps its ``fine_tuned_model``. Another tenant's model is a 404, as it is to
    every other route here."""
    if model in registry.names():
        raise Forbidden(
            f"model {model!r} is a base model; base models cannot be deleted, only your "
            "fine-tuned models (ft:...)",
            param="model",
            code="base_model",
        )
    adapter = owned_adapter(session, principal.tenant_id, model)
    job_id = adapter.job_id
    # its shares go with it (ON DELETE CASCADE); of two deletes racing, one deletes it
    gone = session.execute(
        delete(Adapter).where(Adapter.id == adapter.id).execution_options(synchronize_session=False)
    )
    session.commit()
    if not getattr(gone, "rowcount", 0):
        raise NotFound(
            f"model {model!r} was deleted meanwhile; list yours with GET /v1/models",
            param="model",
            code="model_not_found",
        )
    # After the commit: a failure here leaves unreferenced weights, never a model
    # listed without them.
    for key in (store.adapter_key(job_id), store.merged_key(job_id)):
        store.delete(key)
    return {"id": model, "object": "model", "deleted": True}
