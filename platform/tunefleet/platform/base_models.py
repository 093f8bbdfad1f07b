"""Adding and removing base models: the admin API's ``/v1/admin/base_models`` and the
``tunefleet models add | list | remove`` commands.

A model is added from a folder on this machine or from object storage (``s3://`` under
the artifact store's location, fetched through the node's cache). It is checked first
(``model_check``: config and weights agree, a supported architecture, a tokenizer and a
chat template), copied into a hidden folder of the registry, checked again there, and
renamed into place: other processes see all of it or nothing. Removal is refused while a
job that has not finished or an adapter names the model, and renames it out of the
registry before deleting it. Both are on the audit log (``base_model.add``,
``base_model.remove``).

The registry is a folder every node mounts (the chart's ``models.existingClaim``, a
ReadWriteMany volume, writable by the API pods): a model added here is at once on every
node, which copies it into its model cache as it first loads it (``model_cache``, with
``TUNEFLEET_MODEL_CACHE_SIZE`` set). A registry baked into the image is read-only, and
adding to it is refused.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from tunefleet.platform import audit
from tunefleet.platform.artifacts import Store
from tunefleet.platform.db import Adapter, Job
from tunefleet.platform.errors import Conflict, InvalidRequest, NotFound
from tunefleet.platform.model_check import (
    PICKLE_SUFFIXES,
    TEMPLATE_FILE,
    ModelCheck,
    check_model_folder,
    check_template,
)
from tunefleet.platform.models import ModelRegistry
from tunefleet.platform.status import ACTIVE

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_SHOWN = 10  # users named in a refused removal


def base_model_view(registry: ModelRegistry, name: str) -> dict[str, Any]:
    """A registry model as the admin API shows it; ``problem`` says why a folder placed by
    hand would be refused on add (it is still listed, and jobs may still name it)."""
    view: dict[str, Any] = {"id": name, "object": "base_model", "created": registry.created(name)}
    try:
        view |= asdict(check_model_folder(registry.path(name))) | {"problem": None}
    except InvalidRequest as exc:
        view["problem"] = exc.message
    return view


@contextlib.contextmanager
def _source_folder(
    source: str, store: Store, import_dir: Path | None, *, any_path: bool
) -> Iterator[Path]:
    """The folder ``source`` names, on this machine: a local path (inside ``import_dir``
    unless ``any_path``, the operator's CLI), or ``s3://`` under the store, pinned in the
    node's cache while it is copied."""
    if source.startswith("s3://"):
        location = store.location.rstrip("/")
        if not location.startswith("s3://") or not source.startswith(location + "/"):
            raise InvalidRequest(
                f"source {source!r} is not in the artifact store ({location}); copy the "
                "model under it, or give a folder on this machine",
                param="source",
            )
        key = source[len(location) + 1 :].strip("/")
        try:
            pin = store.pinned_copy(key)
        except FileNotFoundError as exc:
            raise InvalidRequest(f"source {source!r} holds nothing", param="source") from exc
        with pin as folder:
            yield folder
        return
    if "://" in source:
        raise InvalidRequest(
            f"source {source!r}: give a folder path or an s3:// URI", param="source"
        )
    folder = Path(source).resolve()
    if not any_path:
        if import_dir is None:
            raise InvalidRequest(
                f"source {source!r}: the API adds base models from a local folder only "
                "inside TUNEFLEET_MODEL_IMPORT_DIR, which is not set; set it, give an s3:// "
                "URI in the artifact store, or run `tunefleet models add` on the machine",
                param="source",
            )
        if not folder.is_relative_to(import_dir.resolve()):
            raise InvalidRequest(
                f"source {source!r} is not inside TUNEFLEET_MODEL_IMPORT_DIR ({import_dir})",
                param="source",
            )
    yield folder


def add_base_model(
    session: Session,
    registry: ModelRegistry,
    store: Store,
    name: str,
    source: str,
    *,
    actor: audit.Actor,
    chat_template: str | None = None,
    import_dir: Path | None = None,
    any_path: bool = False,
) -> dict[str, Any]:
    """Check ``source``'s model and copy it into the registry as ``name`` (see the
    module's docstring); its view. The audit entry joins ``session``'s transaction."""
    if not NAME.fullmatch(name):
        raise InvalidRequest(
            f"base model name {name!r}: 1-128 letters, digits, '.', '_' and '-', starting "
            "with a letter or digit",
            param="name",
        )
    if chat_template is not None:
        check_template(chat_template)
    if name in registry.names() or registry.path(name).exists():
        raise Conflict(f"base model {name!r} is already in the registry; remove it first")
    with _source_folder(source, store, import_dir, any_path=any_path) as folder:
        check_model_folder(folder, chat_template=chat_template)
        tmp = registry.root / f".adding-{name}-{uuid.uuid4().hex[:8]}"
        try:
            registry.root.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
        except OSError as exc:
            raise Conflict(
                f"the registry folder {registry.root} cannot be written here ({exc.strerror}): "
                "mount a ReadWriteMany volume there, writable by this process (the chart's "
                "models.existingClaim), to add models"
            ) from exc
        try:
            for file in sorted(folder.iterdir()):
                # top-level files only: repos carry their originals in sub-folders
                # (Llama's original/consolidated.pth), which nothing here loads
                if file.is_file() and file.suffix not in PICKLE_SUFFIXES:
                    shutil.copyfile(file, tmp / file.name)
            if chat_template is not None:
                (tmp / TEMPLATE_FILE).write_text(chat_template)
            check = check_model_folder(tmp)  # the copy, as it will be served
            try:
                os.rename(tmp, registry.path(name))
            except OSError as exc:
                raise Conflict(f"base model {name!r} was added meanwhile; remove it first") from exc
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    view = _added_view(registry, name, check)
    audit.record(
        session,
        actor,
        "base_model.add",
        target_type="base_model",
        target_id=name,
        tenant_id=None,
        after={"source": source, **{k: v for k, v in view.items() if k != "object"}},
    )
    return view


def _added_view(registry: ModelRegistry, name: str, check: ModelCheck) -> dict[str, Any]:
    return {
        "id": name,
        "object": "base_model",
        "created": registry.created(name),
        **asdict(check),
        "problem": None,
    }


def users_of(session: Session, name: str) -> tuple[list[str], list[str]]:
    """Jobs not finished and adapters that name base model ``name``: their ids, names."""
    jobs = session.scalars(
        select(Job.id).where(Job.model == name, Job.status.in_(ACTIVE)).order_by(Job.id)
    )
    adapters = session.scalars(
        select(Adapter.name).where(Adapter.base_model == name).order_by(Adapter.name)
    )
    return list(jobs), list(adapters)


def remove_base_model(
    session: Session, registry: ModelRegistry, name: str, *, actor: audit.Actor
) -> dict[str, Any]:
    """Delete ``name`` from the registry, refused while anything uses it (see the module's
    docstring); what it was."""
    if name not in registry.names():
        raise NotFound(f"no base model {name!r} in the registry", param="name")
    jobs, adapters = users_of(session, name)
    if jobs or adapters:
        named = [f"job {j}" for j in jobs] + [f"adapter {a}" for a in adapters]
        more = f" and {len(named) - _SHOWN} more" if len(named) > _SHOWN else ""
        raise Conflict(
            f"base model {name!r} is in use by {', '.join(named[:_SHOWN])}{more}; cancel or "
            "wait for the jobs and delete the adapters (DELETE /v1/models/{adapter}) first"
        )
    view = base_model_view(registry, name)
    gone = registry.root / f".removing-{name}-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(registry.path(name), gone)
    except OSError as exc:
        raise Conflict(
            f"the registry folder {registry.root} cannot be written here ({exc.strerror}): "
            "remove the model where the registry is writable"
        ) from exc
    shutil.rmtree(gone, ignore_errors=True)
    audit.record(
        session,
        actor,
        "base_model.remove",
        target_type="base_model",
        target_id=name,
        tenant_id=None,
        before={k: v for k, v in view.items() if k != "object"},
    )
    return {"id": name, "object": "base_model", "deleted": True}
