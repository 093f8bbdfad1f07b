"""``/v1/evals``: OpenAI's Evals API objects, the caller's tenant's own
(``platform/evals.py``): create, list, get, update (name, metadata), delete. The official
SDK's ``client.evals`` calls work against them."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from sqlalchemy import select

from tunefleet.api._deps import PrincipalDep, SessionDep, SettingsDep
from tunefleet.api._openapi import EvalDeleted, EvalList, EvalObject, errors, ok
from tunefleet.api.routes.graders import python_limits
from tunefleet.platform.db import Eval
from tunefleet.platform.db.paging import ordered_after
from tunefleet.platform.errors import NotFound
from tunefleet.platform.evals import EvalCreate, EvalUpdate, PythonCriterion, eval_view
from tunefleet.platform.ids import new_id

router = APIRouter(prefix="/v1/evals", tags=["evals"])


def _get(
    session: SessionDep, principal: PrincipalDep, eval_id: str, param: str = "eval_id"
) -> Eval:
    found = session.get(Eval, eval_id)
    if found is None or found.tenant_id != principal.tenant_id:
        raise NotFound(f"no eval with id {eval_id!r}", param=param)
    return found


@router.post("", responses=ok(EvalObject))
def create_eval(
    body: EvalCreate, session: SessionDep, principal: PrincipalDep, settings: SettingsDep
) -> dict[str, Any]:
    """An eval: the schema of its items and its testing criteria, each checked (a 400
    naming what is wrong otherwise); python criteria where the operator allows them."""
    for criterion in body.testing_criteria:
        if isinstance(criterion, PythonCriterion):
            python_limits(criterion, settings)
    now = time.time_ns()
    row = Eval(
        id=new_id("eval"),
        tenant_id=principal.tenant_id,
        name=body.name,
        data_source_config=body.data_source_config.view(),
        testing_criteria=[
            c.model_dump(mode="json", exclude_none=True) for c in body.testing_criteria
        ],
        metadata_=body.metadata or {},
        created_ns=now,
        updated_ns=now,
    )
    session.add(row)
    session.commit()
    return eval_view(row)


@router.get("", responses={**ok(EvalList), **errors(404)})
def list_evals(
    session: SessionDep,
    principal: PrincipalDep,
    after: Annotated[str | None, Query(description="An eval id: list the evals after it.")] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "asc",
    order_by: Literal["created_at", "updated_at"] = "created_at",
) -> dict[str, Any]:
    """The caller's evals by ``order_by``, then id (a total order: ``after`` pages neither
    skip nor repeat one), oldest first unless ``order=desc``, as OpenAI lists them."""
    key = Eval.created_ns if order_by == "created_at" else Eval.updated_ns
    anchor = None
    if after:
        found = _get(session, principal, after, param="after")
        anchor = (found.created_ns if order_by == "created_at" else found.updated_ns, found.id)
    query = select(Eval).where(Eval.tenant_id == principal.tenant_id)
    paged = ordered_after(query, key, Eval.id, anchor, descending=order == "desc")
    rows = list(session.scalars(paged.limit(limit + 1)))
    data = [eval_view(e) for e in rows[:limit]]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(rows) > limit,
    }


@router.get("/{eval_id}", responses={**ok(EvalObject), **errors(404)})
def get_eval(eval_id: str, session: SessionDep, principal: PrincipalDep) -> dict[str, Any]:
    return eval_view(_get(session, principal, eval_id))


@router.post("/{eval_id}", responses={**ok(EvalObject), **errors(404)})
def update_eval(
    eval_id: str, body: EvalUpdate, session: SessionDep, principal: PrincipalDep
) -> dict[str, Any]:
    """Rename an eval or replace its metadata (what OpenAI lets change)."""
    row = _get(session, principal, eval_id)
    if body.name is not None:
        row.name = body.name
    if body.metadata is not None:
        row.metadata_ = body.metadata
    row.updated_ns = time.time_ns()
    session.commit()
    return eval_view(row)


@router.delete("/{eval_id}", responses={**ok(EvalDeleted), **errors(404)})
def delete_eval(eval_id: str, session: SessionDep, principal: PrincipalDep) -> dict[str, Any]:
    session.delete(_get(session, principal, eval_id))
    session.commit()
    return {"object": "eval.deleted", "deleted": True, "eval_id": eval_id}
