"""``/v1/models``: the base models in the registry and the caller's fine-tuned models."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from sqlalchemy import select

from tunefleet.api.deps import PrincipalDep, RegistryDep, SessionDep
from tunefleet.platform.db import Adapter
from tunefleet.platform.errors import NotFound

router = APIRouter(prefix="/v1/models", tags=["models"])


def _base(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "tunefleet", "parent": None}


def _adapter(a: Adapter, tenant_name: str) -> dict[str, Any]:
    return {
        "id": a.name,
        "object": "model",
        "created": a.created_at,
        "owned_by": tenant_name,
        "parent": a.base_model,
    }


@router.get("")
async def list_models(
    session: SessionDep, principal: PrincipalDep, registry: RegistryDep
) -> dict[str, Any]:
    adapters = session.scalars(
        select(Adapter).where(Adapter.tenant_id == principal.tenant_id).order_by(Adapter.created_at)
    )
    data = [_base(n) for n in registry.names()]
    data += [_adapter(a, principal.tenant_name) for a in adapters]
    return {"object": "list", "data": data}


@router.get("/{model:path}")
async def retrieve_model(
    model: str, session: SessionDep, principal: PrincipalDep, registry: RegistryDep
) -> dict[str, Any]:
    if model in registry.names():
        return _base(model)
    adapter = session.scalar(
        select(Adapter).where(Adapter.name == model, Adapter.tenant_id == principal.tenant_id)
    )
    if adapter is None:
        raise NotFound(
            f"no model named {model!r}; list yours with GET /v1/models",
            param="model",
            code="model_not_found",
        )
    return _adapter(adapter, principal.tenant_name)
