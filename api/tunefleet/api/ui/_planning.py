"""The dashboard's planner page (``/ui/planner``): "will it fit?". A model, a method, a
per-device batch, a sequence length and a number of GPUs in; out, the seeds'
step-by-step chart (DDP, + gradient checkpointing, ZeRO-3, + CPU offload) drawn as
memory bars against the device, and the advice job creation would follow. The same dry
run as ``POST /v1/plans`` (``jobs.dry_run``); a GET form, so a plan is a link to share."""

from __future__ import annotations

from typing import Any, get_args

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse
from pydantic import ValidationError

from tunefleet.api._deps import RegistryDep, SettingsDep
from tunefleet.api.ui import _charts as charts
from tunefleet.api.ui._render import UiRoute, page
from tunefleet.api.ui._session import ViewerDep
from tunefleet.platform.errors import TuneFleetError
from tunefleet.platform.jobs import JobCreateRequest, dry_run
from tunefleet.platform.planner import HEADROOM, PlanDevice
from tunefleet.platform.spec import Method

router = APIRouter(prefix="/ui", route_class=UiRoute, include_in_schema=False)
METHODS = get_args(Method)
PRECISIONS = ("bf16", "fp16", "fp32")
STEP_LABELS = {  # in the table; the chart's own are shorter, to stay legible on a phone
    ("ddp", False): ("DDP", "DDP"),
    ("ddp", True): ("+ gradient checkpointing", "+ checkpointing"),
    ("zero3", True): ("ZeRO-3 (FSDP)", "ZeRO-3"),
    ("zero3_offload", True): ("+ CPU offload", "+ offload"),
}


def _request(form: dict[str, Any]) -> JobCreateRequest:
    """The job the form describes: its method and precision, ``gpus`` workers of one GPU
    each at ``batch`` examples per device, one epoch (no training file is read)."""
    return JobCreateRequest.model_validate(
        {
            "model": form["model"],
            "training_file": "file-planner",
            "hyperparameters": {"n_epochs": 1, "batch_size": form["batch"] * form["gpus"]},
            "tunefleet": {
                "method": form["method"],
                "precision": form["precision"],
                "max_seq_len": form["seq"],
                "micro_batch_size": form["batch"],
                "resources": {"num_workers": form["gpus"], "gpus_per_worker": 1},
            },
        }
    )


def _ints(raw: dict[str, str], bounds: dict[str, tuple[int, int]]) -> dict[str, int]:
    out = {}
    for name, (low, high) in bounds.items():
        try:
            value = int(raw[name])
        except ValueError:
            raise ValueError(f"{name} {raw[name]!r} is not a whole number") from None
        if not low <= value <= high:
            raise ValueError(f"{name} {value} is out of range; use {low} to {high}")
        out[name] = value
    return out


@router.get("/planner")
def planner_page(
    request: Request,
    viewer: ViewerDep,
    registry: RegistryDep,
    settings: SettingsDep,
    model: str = "",
    method: str = "lora",
    precision: str = "bf16",
    batch: str = "1",
    seq: str = "2048",
    gpus: str = "1",
    memory: str = "",
) -> HTMLResponse:
    names = registry.names()
    raw = {"batch": batch, "seq": seq, "gpus": gpus}
    form: dict[str, Any] = {
        "model": model or (names[0] if names else ""),
        "method": method,
        "precision": precision,
        **raw,
        "memory": memory or f"{settings.device_memory_gb:g}",
    }
    context: dict[str, Any] = {
        "viewer": viewer,
        "nav": "planner",
        "names": names,
        "methods": METHODS,
        "precisions": PRECISIONS,
        "form": form,
        "plan": None,
        "problem": "",
    }
    if not model:  # the empty form
        return page(request, "planner.html", context)
    try:
        if method not in METHODS or precision not in PRECISIONS:
            raise ValueError(
                f"method {method!r} or precision {precision!r} is not one the planner knows"
            )
        numbers = _ints(raw, {"batch": (1, 4096), "seq": (1, 1_048_576), "gpus": (1, 4096)})
        try:
            memory_gb = float(form["memory"])
        except ValueError:
            raise ValueError(f"device memory {form['memory']!r} is not a number") from None
        if not 0 < memory_gb <= 1_000_000:
            raise ValueError(f"device memory {memory_gb:g} GiB is out of range")
        req = _request({**form, **numbers})
        registry.require(req.model)
        device = PlanDevice.from_gb(memory_gb, settings.host_memory_gb)
        plan = dry_run(
            req, registry.config(req.model), tenant_id=viewer.principal.tenant_id, device=device
        )
    except (ValueError, ValidationError, TuneFleetError) as exc:
        context["problem"] = _message(exc)
        return page(request, "planner.html", context, 400)
    context["plan"] = plan
    context["steps"] = [(step_label(s), s) for s in plan["chart"]]
    context["budget"] = plan["device"]["memory_bytes"] * HEADROOM
    context["chart"] = memory_bars(plan, title=f"Memory per GPU: {req.model}, {method}")
    context["legend"] = charts.memory_legend()
    return page(request, "planner.html", context)


def step_label(step: dict[str, Any], *, short: bool = False) -> str:
    key = (str(step["strategy"]), bool(step["gradient_checkpointing"]))
    long, brief = STEP_LABELS.get(key, (key[0], key[0]))
    return brief if short else long


def memory_bars(plan: dict[str, Any], *, title: str, chart_id: str = "memory") -> Any:
    """The seeds' chart of ``plan`` (a dry run's, with ``chart``) as memory bars."""
    device = plan["device"]["memory_bytes"]
    rows = [(step_label(s, short=True), s["breakdown"]) for s in plan["chart"]]
    fitting = [step_label(s) for s in plan["chart"] if s["fits"]]
    batch = plan["input"]["per_device_batch"]
    desc = (
        f"Per-GPU memory of each step of the tuning chart at {batch} example(s) per GPU, "
        f"against {device / 2**30:.1f} GiB of device memory; "
        + (f"fits: {', '.join(fitting)}." if fitting else "no step fits.")
    )
    return charts.memory_chart(
        rows,
        device_bytes=device,
        budget_bytes=device * HEADROOM,
        title=title,
        desc=desc,
        chart_id=chart_id,
    )


def _message(exc: Exception) -> str:
    if isinstance(exc, TuneFleetError):
        return exc.message
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        return f"{where}: {first['msg']}"
    return str(exc)
