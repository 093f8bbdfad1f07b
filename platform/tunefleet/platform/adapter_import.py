"""Adapters users bring: a peft LoRA adapter trained elsewhere, uploaded as a ``.tar`` or
``.zip`` file (purpose ``adapter``) or placed in object storage, becomes a fine-tuned model
of the tenant, served, shared, deleted and trained further like one TuneFleet trained.

- ``unpack_archive``: an upload's archive into a folder, regular files only, nothing
  outside it (no absolute or ``..`` names, no links or devices), within a size and member
  count; the folder holding ``adapter_config.json`` (at the top or one folder down).
- ``check_adapter_folder``: the adapter against its base, without loading either: a LoRA
  whose every option TuneFleet's serving and training apply exactly (no DoRA-free
  surprises: DoRA is served merged), a rank within ``max_rank``, targets among the base's
  linear layers, and every factor of the shape the base's module needs, read from the
  safetensors headers. A mismatch names the module and the shapes.
- ``import_adapter``: the import itself. It is recorded as a job of the tenant that
  succeeded at once (``tunefleet.imported_from`` on the job), so everything keyed by a
  job works for it unchanged: its adapter's weights under ``adapters/{job id}``, the model
  name ``ft:{base}:{tenant}:{name}:adapter-{id}``, serving by job id, sharing, deletion,
  and ``tunefleet.init_from_job`` naming it to train it further.
"""

from __future__ import annotations

import contextlib
import shutil
import stat
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from sqlalchemy.orm import Session

from tunefleet.platform.artifacts import Store
from tunefleet.platform.db import Adapter, File, Job, JobEvent, Tenant, now_s
from tunefleet.platform.errors import InvalidRequest, NotFound
from tunefleet.platform.ids import new_id
from tunefleet.platform.model_check import PICKLE_SUFFIXES, model_tensors, read_json, tensor_header
from tunefleet.platform.models import ModelRegistry
from tunefleet.platform.spec import (
    TARGET_MODULES,
    Hyperparameters,
    JobSpec,
    LoraOptions,
    TuneFleetOptions,
)
from tunefleet.platform.status import JobStatus
from tunefleet.platform.tenants import Principal

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
KEPT = (CONFIG, WEIGHTS, "README.md")  # what is copied into the store
ARCHIVES = (".tar", ".zip")
MAX_MEMBERS = 64
_PREFIX = "base_model.model."
_FACTORS = (".lora_A.weight", ".lora_B.weight", ".lora_magnitude_vector")
# LoraConfig options whose non-default values TuneFleet cannot train or serve as given
_UNSUPPORTED = {
    "modules_to_save": "whole modules trained beside the LoRA factors",
    "rank_pattern": "a rank per module",
    "alpha_pattern": "an alpha per module",
    "layers_to_transform": "LoRA on some layers only",
    "exclude_modules": "excluded modules",
    "target_parameters": "LoRA on parameters rather than modules",
    "trainable_token_indices": "trained token embeddings",
    "layer_replication": "replicated layers",
    "use_qalora": "QA-LoRA",
    "lora_bias": "a bias on lora_B",
}


def _bad(message: str, param: str) -> InvalidRequest:
    return InvalidRequest(message, param=param, code="invalid_adapter")


def unpack_archive(archive: Path, into: Path, *, max_bytes: int, param: str = "file") -> Path:
    """Extract ``archive`` (tar, possibly compressed, or zip) into ``into``; the folder of
    it that holds ``adapter_config.json``. Refused, naming the member: anything but
    regular files and folders, a name outside ``into``, more than ``MAX_MEMBERS`` members
    or ``max_bytes`` unpacked."""

    def place(name: str) -> Path:
        path = PurePosixPath(name)
        if path.is_absolute() or ".." in path.parts or "\\" in name or "\x00" in name:
            raise _bad(
                f"the archive's member {name[:200]!r} would be written outside it; "
                "pack the adapter's folder with relative names",
                param,
            )
        return into / Path(*path.parts) if path.parts else into

    members: list[tuple[str, bool, int, Any]] = []  # (name, is folder, size, handle)
    if zipfile.is_zipfile(archive):
        zipped = zipfile.ZipFile(archive)
        for info in zipped.infolist():
            kind = stat.S_IFMT(info.external_attr >> 16)
            if kind not in (0, stat.S_IFREG, stat.S_IFDIR):
                raise _bad(
                    f"the archive's member {info.filename[:200]!r} is a link or a "
                    "special file; only regular files are read",
                    param,
                )
            members.append((info.filename, info.is_dir(), info.file_size, info))
        opened: Any = zipped
    else:
        try:
            opened = tarfile.open(archive)  # noqa: SIM115 (closed below)
        except (tarfile.TarError, OSError) as exc:
            raise _bad(
                f"the file is neither a tar nor a zip archive ({exc}); upload the "
                "adapter's folder packed with tar or zip",
                param,
            ) from None
        for info in opened.getmembers():
            if not (info.isfile() or info.isdir()):
                raise _bad(
                    f"the archive's member {info.name[:200]!r} is a link or a "
                    "special file; only regular files are read",
                    param,
                )
            members.append((info.name, info.isdir(), info.size, info))
    with opened:
        if len(members) > MAX_MEMBERS:
            raise _bad(
                f"the archive has {len(members)} members, more than {MAX_MEMBERS}; "
                "pack only the adapter's folder",
                param,
            )
        total = sum(size for _, _, size, _ in members)
        if total > max_bytes:
            raise _bad(
                f"the archive unpacks to {total} bytes, more than the {max_bytes} "
                "allowed (TUNEFLEET_MAX_UPLOAD_BYTES)",
                param,
            )
        for name, is_dir, _, handle in members:
            target = place(name)
            if is_dir:
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            source = (
                opened.open(handle)
                if isinstance(opened, zipfile.ZipFile)
                else (opened.extractfile(handle))
            )
            assert source is not None
            try:
                with source, target.open("xb") as out:
                    shutil.copyfileobj(source, out)
            except (FileExistsError, IsADirectoryError):
                raise _bad(
                    f"the archive holds {name[:200]!r} twice (or as a file and a folder); "
                    "pack each file once",
                    param,
                ) from None
    found = sorted(p.parent for p in into.rglob(CONFIG))
    if not found or len(found[0].relative_to(into).parts) > 1 or len(found) > 1:
        raise _bad(
            f"the archive holds no {CONFIG} at its top or one folder down (or more "
            "than one); pack the folder peft's save_pretrained writes",
            param,
        )
    return found[0]


@dataclass(frozen=True)
class AdapterCheck:
    """What a checked adapter is."""

    r: int
    alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool
    use_dora: bool
    parameters: int
    weight_bytes: int

    def lora_options(self, dropout: float = 0.0) -> LoraOptions:
        return LoraOptions(
            r=self.r,
            alpha=int(self.alpha),
            dropout=dropout,
            target_modules=list(self.target_modules),
            use_rslora=self.use_rslora,
            use_dora=self.use_dora,
        )


def check_adapter_folder(
    folder: Path, base_folder: Path, *, max_rank: int, param: str = "file"
) -> AdapterCheck:
    """``folder``'s peft LoRA adapter checked against the base model in ``base_folder``
    (see the module's docstring); refused with an ``invalid_adapter`` 400 naming the file,
    the module and the fix."""
    for path in folder.rglob("*"):
        if path.suffix in PICKLE_SUFFIXES:
            raise _bad(
                f"{path.name} is a pickle file (loading it runs code); save the "
                "adapter with safe_serialization=True: safetensors only",
                param,
            )
    if not (folder / CONFIG).is_file() or not (folder / WEIGHTS).is_file():
        raise _bad(
            f"a peft adapter needs {CONFIG} and {WEIGHTS}; give the folder peft's "
            "save_pretrained writes",
            param,
        )
    config = read_json(folder / CONFIG, param=param)
    if not isinstance(config, dict):
        raise _bad(f"{CONFIG} is not a JSON object", param)
    if config.get("peft_type", "LORA") != "LORA":
        raise _bad(
            f"{CONFIG} says peft_type {config.get('peft_type')!r}; TuneFleet imports "
            "LoRA adapters (peft_type LORA)",
            param,
        )
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise _bad(
                f"{CONFIG} sets {key} ({what}), which TuneFleet does not serve or "
                f"train; train the adapter without it",
                param,
            )
    if config.get("bias", "none") != "none" or config.get("fan_in_fan_out"):
        raise _bad(
            f"{CONFIG} trains biases or sets fan_in_fan_out; TuneFleet imports "
            "LoRA with bias 'none' on linear layers",
            param,
        )
    r, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(r, int) or isinstance(r, bool) or not 1 <= r <= max_rank:
        raise _bad(
            f"{CONFIG} has rank r={r!r}; ranks from 1 to {max_rank} are served here "
            "(TUNEFLEET_ADAPTER_MAX_RANK)",
            param,
        )
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or alpha <= 0:
        raise _bad(f"{CONFIG} has lora_alpha {alpha!r}; give a positive number", param)
    targets = config.get("target_modules")
    if isinstance(targets, str):
        raise _bad(
            f"{CONFIG} gives target_modules as the pattern {targets!r}; give them as "
            f"a list of names among {', '.join(TARGET_MODULES)}",
            param,
        )
    if not isinstance(targets, list) or not targets:
        raise _bad(f"{CONFIG} names no target_modules", param)
    unknown = sorted(set(targets) - set(TARGET_MODULES))
    if unknown:
        raise _bad(
            f"{CONFIG} targets {unknown}, which are not linear layers TuneFleet "
            f"adapts; use some of {', '.join(TARGET_MODULES)}",
            param,
        )

    base = {name: t for name, t in model_tensors(base_folder).items()}
    tensors = tensor_header(folder / WEIGHTS, param=param)
    dora = bool(config.get("use_dora"))
    modules: dict[str, dict[str, list[int]]] = {}
    for key, tensor in tensors.items():
        factor = next((f for f in _FACTORS if key.endswith(f)), None)
        if factor is None or not key.startswith(_PREFIX):
            raise _bad(
                f"{WEIGHTS} holds {key[:200]!r}, which is not a LoRA factor of a "
                "linear layer; save only the adapter's LoRA weights",
                param,
            )
        if tensor.get("dtype") not in ("F32", "BF16", "F16"):
            raise _bad(
                f"{WEIGHTS}: {key} is {tensor.get('dtype')}; give float32, bfloat16 "
                "or float16 factors",
                param,
            )
        module = key[len(_PREFIX) : -len(factor)]
        modules.setdefault(module, {})[factor] = list(tensor["shape"])
    if not modules:
        raise _bad(f"{WEIGHTS} holds no LoRA weights", param)
    parameters = 0
    for module, factors in sorted(modules.items()):
        name = module.rsplit(".", 1)[-1]
        weight = base.get(f"{module}.weight")
        if weight is None or len(weight["shape"]) != 2:
            raise _bad(
                f"{WEIGHTS} adapts {module}, which the base model has no linear "
                "layer named; was the adapter trained on another model?",
                param,
            )
        if name not in targets:
            raise _bad(
                f"{WEIGHTS} adapts {module}, but {CONFIG}'s target_modules "
                f"{targets} do not name {name!r}; add it there",
                param,
            )
        out, into = weight["shape"]
        expected = {".lora_A.weight": [r, into], ".lora_B.weight": [out, r]}
        if dora:
            expected[".lora_magnitude_vector"] = [out]
        for factor, shape in expected.items():
            got = factors.get(factor)
            if got != shape:
                what = "is missing" if got is None else f"has shape {got}"
                raise _bad(
                    f"{WEIGHTS}: {module}{factor} {what}; the base's {module} is "
                    f"[{out}, {into}] (out, in), so rank {r} needs {shape}",
                    param,
                )
        if set(factors) - set(expected):
            extra = sorted(set(factors) - set(expected))
            raise _bad(
                f"{WEIGHTS}: {module} has {extra}, which {CONFIG} (use_dora "
                f"{dora}) does not account for",
                param,
            )
        parameters += r * (out + into) + (out if dora else 0)
    adapted = {m.rsplit(".", 1)[-1] for m in modules}
    if missing := sorted(set(targets) - adapted):
        raise _bad(f"{CONFIG} targets {missing}, for which {WEIGHTS} holds no factors", param)
    return AdapterCheck(
        r=r,
        alpha=float(alpha),
        target_modules=tuple(sorted(set(targets), key=TARGET_MODULES.index)),
        use_rslora=bool(config.get("use_rslora")),
        use_dora=dora,
        parameters=parameters,
        weight_bytes=(folder / WEIGHTS).stat().st_size,
    )


def import_prefix(store: Store, tenant_name: str) -> str:
    """Where in object storage a tenant's adapters may be imported from: under the store,
    ``imports/{tenant name}/``. Nothing else of the store: that holds every tenant's
    artifacts."""
    return f"{store.location.rstrip('/')}/imports/{tenant_name}/"


@contextlib.contextmanager
def _source(
    session: Session,
    principal: Principal,
    store: Store,
    file_id: str | None,
    source: str | None,
    max_bytes: int,
) -> Iterator[tuple[Path, str]]:
    """The adapter's folder on this machine, and what to call its origin."""
    if (file_id is None) == (source is None):
        raise InvalidRequest(
            "give exactly one of file_id (an uploaded .tar or .zip of "
            "purpose adapter) and source (s3://...)",
            param="file_id",
        )
    if file_id is not None:
        row = session.get(File, file_id)
        if row is None or row.tenant_id != principal.tenant_id:
            raise NotFound(f"no file with id {file_id!r}", param="file_id")
        if row.purpose != "adapter":
            raise InvalidRequest(
                f"file {file_id} has purpose {row.purpose!r}; upload the "
                "adapter's archive with purpose 'adapter'",
                param="file_id",
            )
        with store.pinned_copy(row.path) as archive, tempfile.TemporaryDirectory() as tmp:
            yield (
                unpack_archive(archive, Path(tmp), max_bytes=max_bytes, param="file_id"),
                (file_id),
            )
        return
    assert source is not None
    prefix = import_prefix(store, principal.tenant_name)
    if not source.startswith("s3://") or not source.startswith(prefix) or ".." in source:
        raise InvalidRequest(
            f"source {source[:200]!r}: adapters are imported from object "
            f"storage under {prefix} (or uploaded as a file)",
            param="source",
        )
    key = source[len(store.location.rstrip("/")) + 1 :].strip("/")
    try:
        pin = store.pinned_copy(key)
    except FileNotFoundError:
        raise NotFound(f"source {source!r} holds nothing", param="source") from None
    with pin as folder:
        yield folder, source


def import_adapter(
    session: Session,
    principal: Principal,
    registry: ModelRegistry,
    store: Store,
    *,
    base_model: str,
    name: str,
    file_id: str | None = None,
    source: str | None = None,
    max_rank: int,
    max_bytes: int,
) -> tuple[Job, Adapter]:
    """Check the adapter (an uploaded archive or ``source``) against ``base_model``, copy
    it into the store and record it (see the module's docstring); its job and adapter,
    committed."""
    from tunefleet.platform.jobs import SUFFIX
    from tunefleet.platform.scheduler import serving_mode

    if base_model not in registry.names():
        raise NotFound(
            f"no base model {base_model!r}; list them with GET /v1/models",
            param="base_model",
            code="model_not_found",
        )
    if not SUFFIX.fullmatch(name):
        raise InvalidRequest(
            f"name {name!r} must be 1-64 letters, digits, '-' or '_'", param="name"
        )
    job_id = new_id("job")
    param = "file_id" if file_id is not None else "source"
    with _source(session, principal, store, file_id, source, max_bytes) as (folder, origin):
        check = check_adapter_folder(
            folder, registry.path(base_model), max_rank=max_rank, param=param
        )
        with tempfile.TemporaryDirectory() as tmp:
            for kept in KEPT:
                if (folder / kept).is_file():
                    shutil.copyfile(folder / kept, Path(tmp) / kept)
            try:
                store.put_dir(store.adapter_key(job_id), Path(tmp))
            except BaseException:  # a copy cut short is never left behind
                store.delete(store.adapter_key(job_id))
                raise
    tenant = session.get(Tenant, principal.tenant_id)
    assert tenant is not None
    model = f"ft:{base_model}:{tenant.name}:{name}:adapter-{job_id.removeprefix('ftjob-')}"
    options = TuneFleetOptions(method="lora", lora=check.lora_options())
    spec = JobSpec(
        job_id=job_id,
        tenant_id=principal.tenant_id,
        model=base_model,
        training_file=file_id or "",
        suffix=name,
        seed=0,
        tunefleet=options,
        hyperparameters=Hyperparameters(n_epochs=1, batch_size=1, learning_rate_multiplier=1),
    )
    now = now_s()
    imported = {"file_id": file_id, "source": source, **asdict(check)}
    job = Job(
        id=job_id,
        tenant_id=principal.tenant_id,
        status=JobStatus.SUCCEEDED.value,
        model=base_model,
        training_file=file_id or "",
        fine_tuned_model=model,
        spec=spec.model_dump(mode="json"),
        request={"tunefleet": {"imported_from": imported}},
        metadata_={},
        created_at=now,
        created_ns=now * 1_000_000_000,
        updated_at=now,
        finished_at=now,
        result_files=[],
    )
    adapter = Adapter(
        id=new_id("adapter"),
        tenant_id=principal.tenant_id,
        job_id=job_id,
        name=model,
        base_model=base_model,
        path=store.adapter_key(job_id),
        serving_mode=serving_mode("lora") if not check.use_dora else "merged",
    )
    targets = ", ".join(check.target_modules)
    event = JobEvent(
        id=new_id("event"),
        job_id=job_id,
        created_at=now,
        level="info",
        type="message",
        message=f"Imported a rank-{check.r} LoRA adapter on {targets} ({check.parameters} "
        f"parameters) from {origin}; fine-tuned model {model}",
        data={"imported_from": imported},
    )
    try:
        session.add(job)
        session.flush()  # the job before the adapter row naming it
        session.add_all([adapter, event])
        session.commit()
    except BaseException:  # nothing names the copied weights: they go too
        session.rollback()
        store.delete(store.adapter_key(job_id))
        raise
    return job, adapter
