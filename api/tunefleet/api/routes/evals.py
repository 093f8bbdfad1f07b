"""``/v1/evals``: OpenAI's Evals API objects, the caller's tenant's own
(``platform/evals.py``): create, list, get, update (name, metadata), delete; and their
runs (``platform/eval_runs.py``, run by the controller: ``workers/_evals.py``): create,
list, get, cancel, delete, and each run's output items. The official SDK's
``client.evals`` and ``client.evals.runs`` calls work against them."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from sqlalchemy import select, update

from tunefleet.api._deps import PrincipalDep, RegistryDep, SessionDep, SettingsDep, StoreDep
from tunefleet.api._openapi import (
    EvalDeleted,
    EvalList,
    EvalObject,
    EvalRunDeleted,
    EvalRunList,
    EvalRunObject,
    OutputItemList,
    OutputItemObject,
    errors,
    ok,
)
from tunefleet.api.routes.graders import python_limits
from tunefleet.api.routes.inference import resolve_model
from tunefleet.platform.db import Eval, EvalOutputItem, EvalRun, File
from tunefleet.platform.db.paging import ordered_after
from tunefleet.platform.errors import Conflict, InvalidRequest, NotFound
from tunefleet.platform.eval_runs import (
    ACTIVE,
    CANCELED,
    QUEUED,
    CompletionsDataSource,
    FileContentSource,
    FileIdSource,
    RunCreate,
    check_items,
    messages_for,
    output_item_view,
    parse_criteria,
    read_jsonl,
    run_view,
)
from tunefleet.platform.evals import EvalCreate, EvalUpdate, PythonCriterion, eval_view
from tunefleet.platform.graders import GraderFailed
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


# -- runs ------------------------------------------------------------------------------
def _run(session: SessionDep, principal: PrincipalDep, eval_id: str, run_id: str) -> EvalRun:
    _get(session, principal, eval_id)
    found = session.get(EvalRun, run_id)
    if found is None or found.eval_id != eval_id:
        raise NotFound(f"no run with id {run_id!r} in eval {eval_id!r}", param="run_id")
    return found


def _source_rows(
    source: FileContentSource | FileIdSource, session: Any, principal: Any, store: Any
) -> list[Any]:
    if isinstance(source, FileContentSource):
        return source.content
    f = session.get(File, source.id)
    if f is None or f.tenant_id != principal.tenant_id:
        raise NotFound(f"no file with id {source.id!r}", param="data_source.source.id")
    if f.purpose != "evals":
        raise InvalidRequest(
            f"file {source.id} has purpose {f.purpose!r}; upload a run's items as JSONL "
            "with purpose 'evals'",
            param="data_source.source.id",
        )
    text = b"".join(store.read_chunks(f.path)).decode("utf-8")
    return read_jsonl(text, f"file {source.id}")


@router.post("/{eval_id}/runs", responses={**ok(EvalRunObject), **errors(404)})
def create_run(
    eval_id: str,
    body: RunCreate,
    session: SessionDep,
    principal: PrincipalDep,
    settings: SettingsDep,
    registry: RegistryDep,
    store: StoreDep,
) -> dict[str, Any]:
    """A run of the eval, queued for the controller: its items checked against the eval's
    item schema, its model resolved (a 404 where the caller may not call it), each item's
    messages made from the template (a 400 naming the item where one cannot be)."""
    found = _get(session, principal, eval_id)
    for criterion in parse_criteria(found.testing_criteria):
        if isinstance(criterion, PythonCriterion):
            python_limits(criterion, settings)
    namespaces = found.data_source_config["schema"]["properties"]
    source = body.data_source.source
    rows = _source_rows(source, session, principal, store)
    generated = isinstance(body.data_source, CompletionsDataSource)
    try:
        items = check_items(
            rows,
            namespaces["item"],
            with_samples=not generated and "sample" in namespaces,
            where="data_source.source",
        )
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="data_source.source") from None
    base = adapter_id = model = ""
    if isinstance(body.data_source, CompletionsDataSource):
        model = body.data_source.model
        base, adapter_id = resolve_model(model, session, principal, registry, store)
        template = body.data_source.input_messages.model_dump(exclude_none=True)
        for i, row in enumerate(items):
            try:
                messages_for(template, row["item"])
            except GraderFailed as exc:
                raise InvalidRequest(
                    f"data_source.input_messages on item {i}: {exc}",
                    param="data_source.input_messages",
                ) from None
    shown = body.data_source.model_dump(mode="json", exclude_none=True)
    now = time.time_ns()
    run = EvalRun(
        id=new_id("eval_run"),
        eval_id=eval_id,
        tenant_id=principal.tenant_id,
        name=body.name or f"{model or 'jsonl'} run",
        status=QUEUED,
        model=model,
        base_model=base,
        adapter_id=adapter_id,
        data_source=shown,
        items=items,
        metadata_=body.metadata or {},
        result_counts={"total": len(items), "passed": 0, "failed": 0, "errored": 0},
        per_testing_criteria_results=[
            {"testing_criteria": c["name"], "passed": 0, "failed": 0}
            for c in found.testing_criteria
        ],
        per_model_usage=[],
        error=None,
        created_ns=now,
        updated_ns=now,
    )
    session.add(run)
    session.commit()
    return run_view(run)


@router.get("/{eval_id}/runs", responses={**ok(EvalRunList), **errors(404)})
def list_runs(
    eval_id: str,
    session: SessionDep,
    principal: PrincipalDep,
    after: Annotated[str | None, Query(description="A run id: list the runs after it.")] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "asc",
    status: Literal["queued", "in_progress", "completed", "canceled", "failed"] | None = None,
) -> dict[str, Any]:
    """The eval's runs by creation, then id, oldest first unless ``order=desc``."""
    _get(session, principal, eval_id)
    anchor = None
    if after:
        at = _run(session, principal, eval_id, after)
        anchor = (at.created_ns, at.id)
    query = select(EvalRun).where(EvalRun.eval_id == eval_id)
    if status:
        query = query.where(EvalRun.status == status)
    paged = ordered_after(query, EvalRun.created_ns, EvalRun.id, anchor, descending=order == "desc")
    rows = list(session.scalars(paged.limit(limit + 1)))
    return _page([run_view(r) for r in rows[:limit]], len(rows) > limit)


def _page(data: list[dict[str, Any]], more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": more,
    }


@router.get("/{eval_id}/runs/{run_id}", responses={**ok(EvalRunObject), **errors(404)})
def get_run(
    eval_id: str, run_id: str, session: SessionDep, principal: PrincipalDep
) -> dict[str, Any]:
    return run_view(_run(session, principal, eval_id, run_id))


@router.post("/{eval_id}/runs/{run_id}/cancel", responses={**ok(EvalRunObject), **errors(404, 409)})
@router.post("/{eval_id}/runs/{run_id}", responses={**ok(EvalRunObject), **errors(404, 409)})
def cancel_run(
    eval_id: str, run_id: str, session: SessionDep, principal: PrincipalDep
) -> dict[str, Any]:
    """Cancel a queued or running run (the SDK's path ends in ``/cancel``; OpenAI's
    reference gives it without): no item is sampled after this; those already graded are
    kept. A run that has ended is a 409."""
    run = _run(session, principal, eval_id, run_id)
    moved = session.execute(
        update(EvalRun)
        .where(EvalRun.id == run_id, EvalRun.status.in_(ACTIVE))
        .values(status=CANCELED, updated_ns=time.time_ns())
    )
    session.commit()
    session.refresh(run)
    if moved.rowcount != 1:  # type: ignore[attr-defined]
        raise Conflict(
            f"run {run_id} has already {run.status.replace('_', ' ')}; only a queued or "
            "in-progress run can be cancelled",
            param="run_id",
        )
    return run_view(run)


@router.delete("/{eval_id}/runs/{run_id}", responses={**ok(EvalRunDeleted), **errors(404)})
def delete_run(
    eval_id: str, run_id: str, session: SessionDep, principal: PrincipalDep
) -> dict[str, Any]:
    """Delete a run and its output items (a running one stops at its next item)."""
    session.delete(_run(session, principal, eval_id, run_id))
    session.commit()
    return {"object": "eval.run.deleted", "deleted": True, "run_id": run_id}


@router.get(
    "/{eval_id}/runs/{run_id}/output_items", responses={**ok(OutputItemList), **errors(404)}
)
def list_output_items(
    eval_id: str,
    run_id: str,
    session: SessionDep,
    principal: PrincipalDep,
    after: Annotated[str | None, Query(description="An output item id: those after it.")] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "asc",
    status: Literal["pass", "fail", "error"] | None = None,
) -> dict[str, Any]:
    """The run's graded items in the order of its data (``datasource_item_id``)."""
    _run(session, principal, eval_id, run_id)
    query = select(EvalOutputItem).where(EvalOutputItem.run_id == run_id)
    if status:
        query = query.where(EvalOutputItem.status == status)
    anchor = None
    if after:
        at = session.get(EvalOutputItem, after)
        if at is None or at.run_id != run_id:
            raise NotFound(f"no output item with id {after!r} in run {run_id!r}", param="after")
        anchor = (at.item_index, at.id)
    paged = ordered_after(
        query, EvalOutputItem.item_index, EvalOutputItem.id, anchor, descending=order == "desc"
    )
    rows = list(session.scalars(paged.limit(limit + 1)))
    return _page([output_item_view(r, eval_id) for r in rows[:limit]], len(rows) > limit)


@router.get(
    "/{eval_id}/runs/{run_id}/output_items/{item_id}",
    responses={**ok(OutputItemObject), **errors(404)},
)
def get_output_item(
    eval_id: str, run_id: str, item_id: str, session: SessionDep, principal: PrincipalDep
) -> dict[str, Any]:
    _run(session, principal, eval_id, run_id)
    found = session.get(EvalOutputItem, item_id)
    if found is None or found.run_id != run_id:
        raise NotFound(f"no output item with id {item_id!r} in run {run_id!r}", param="item_id")
    return output_item_view(found, eval_id)
