"""``tunefleet files ...``, ``tunefleet jobs ...`` and ``tunefleet adapters import``: a thin
HTTP client of the REST API.

The API URL and key come from ``--api-url``/``--api-key`` or the environment
(``TUNEFLEET_API_URL``, ``TUNEFLEET_API_KEY``, falling back to ``OPENAI_API_KEY``).
"""

from __future__ import annotations

import io
import json
import tarfile
import time
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from tqdm import tqdm

files_app = typer.Typer(help="Training files.", no_args_is_help=True)
jobs_app = typer.Typer(help="Fine-tuning jobs.", no_args_is_help=True)
adapters_app = typer.Typer(help="Adapters trained elsewhere.", no_args_is_help=True)

ApiUrl = Annotated[str, typer.Option(envvar="TUNEFLEET_API_URL", help="API base URL.")]
ApiKey = Annotated[
    str, typer.Option(envvar=["TUNEFLEET_API_KEY", "OPENAI_API_KEY"], help="API key tf-...")
]
DEFAULT_URL = "http://127.0.0.1:8080"
TERMINAL = ("succeeded", "failed", "cancelled")


def connect(api_url: str, api_key: str) -> httpx.Client:
    return httpx.Client(
        base_url=api_url, timeout=600, headers={"Authorization": f"Bearer {api_key}"}
    )


def call(client: httpx.Client, method: str, path: str, **kwargs: Any) -> Any:
    """One request; an API error is printed in its own words and exits 1."""
    resp = client.request(method, path, **kwargs)
    if resp.status_code >= 400:
        try:
            err = resp.json()["error"]
            message = f"{resp.status_code} {err.get('code')}: {err['message']}"
        except (ValueError, KeyError, TypeError):
            message = f"{resp.status_code}: {resp.text[:500]}"
        typer.echo(f"error: {message}", err=True)
        raise typer.Exit(1)
    return resp.json()


def show(obj: Any) -> None:
    typer.echo(json.dumps(obj, indent=2))


def follow(client: httpx.Client, job_id: str, *, poll_s: float = 1.0) -> dict[str, Any]:
    """Print a job's messages and a live progress bar (step, loss, ETA) until it ends."""
    bar = tqdm(total=None, desc=job_id[-8:], unit="step")
    seen: set[str] = set()
    try:
        while True:
            job: dict[str, Any] = call(client, "GET", f"/v1/fine_tuning/jobs/{job_id}")
            page = call(
                client, "GET", f"/v1/fine_tuning/jobs/{job_id}/events", params={"limit": 200}
            )
            for ev in reversed(page["data"]):
                if ev["id"] in seen:
                    continue
                seen.add(ev["id"])
                data = ev.get("data") or {}
                if ev["type"] == "metrics" and "step" in data:
                    bar.total = data.get("total_steps")
                    bar.n = data["step"]
                    bar.set_postfix(loss=f"{data.get('train_loss', float('nan')):.4f}")
                    bar.refresh()
                else:
                    tqdm.write(f"[{ev['level']}] {ev['message']}")
            if job["status"] in TERMINAL:
                return job
            time.sleep(poll_s)
    finally:
        bar.close()


@files_app.command("upload")
def files_upload(
    path: Path, api_url: ApiUrl = DEFAULT_URL, api_key: ApiKey = "", purpose: str = "fine-tune"
) -> None:
    """Upload a JSONL training file."""
    with connect(api_url, api_key) as client, path.open("rb") as fh:
        show(
            call(
                client,
                "POST",
                "/v1/files",
                data={"purpose": purpose},
                files={"file": (path.name, fh, "application/jsonl")},
            )
        )


@adapters_app.command("import")
def adapters_import(
    base_model: str,
    name: str,
    source: Annotated[
        str, typer.Argument(help="A peft adapter's folder, a .tar/.zip of it, or s3://...")
    ],
    api_url: ApiUrl = DEFAULT_URL,
    api_key: ApiKey = "",
) -> None:
    """Import a peft LoRA adapter as one of your fine-tuned models (checked against its
    base first): a folder is packed and uploaded, an archive uploaded as it is, an
    ``s3://`` folder (under the store's imports/YOUR-TENANT/) read where it is."""
    body: dict[str, Any] = {"base_model": base_model, "name": name}
    with connect(api_url, api_key) as client:
        if source.startswith("s3://"):
            body["source"] = source
        else:
            path = Path(source)
            if path.is_dir():
                packed = io.BytesIO()
                with tarfile.open(fileobj=packed, mode="w") as tar:
                    tar.add(path, arcname=path.name)
                upload: Any = (f"{path.name}.tar", packed.getvalue())
            else:
                upload = (path.name, path.read_bytes())
            f = call(client, "POST", "/v1/files", data={"purpose": "adapter"},
                     files={"file": upload})  # fmt: skip
            body["file_id"] = f["id"]
        show(call(client, "POST", "/v1/models", json=body))


@files_app.command("list")
def files_list(api_url: ApiUrl = DEFAULT_URL, api_key: ApiKey = "") -> None:
    with connect(api_url, api_key) as client:
        for f in call(client, "GET", "/v1/files")["data"]:
            typer.echo(f"{f['id']}  {f['bytes']:>10}  {f['filename']}")


@jobs_app.command("create")
def jobs_create(
    model: str,
    training_file: str,
    api_url: ApiUrl = DEFAULT_URL,
    api_key: ApiKey = "",
    suffix: Annotated[str | None, typer.Option()] = None,
    epochs: Annotated[int | None, typer.Option()] = None,
    batch_size: Annotated[int | None, typer.Option()] = None,
    lr_multiplier: Annotated[float | None, typer.Option()] = None,
    options: Annotated[
        str | None, typer.Option(help='TuneFleet controls as JSON, e.g. \'{"lora": {"r": 16}}\'')
    ] = None,
    follow_: Annotated[bool, typer.Option("--follow", help="Watch until it ends.")] = False,
) -> None:
    """Create a fine-tuning job."""
    hp = {
        k: v
        for k, v in (
            ("n_epochs", epochs),
            ("batch_size", batch_size),
            ("learning_rate_multiplier", lr_multiplier),
        )
        if v is not None
    }
    body: dict[str, Any] = {"model": model, "training_file": training_file}
    if suffix:
        body["suffix"] = suffix
    if hp:
        body["method"] = {"type": "supervised", "supervised": {"hyperparameters": hp}}
    if options:
        body["tunefleet"] = json.loads(options)
    with connect(api_url, api_key) as client:
        job = call(client, "POST", "/v1/fine_tuning/jobs", json=body)
        show(job)
        if follow_:
            show(follow(client, job["id"]))


@jobs_app.command("list")
def jobs_list(api_url: ApiUrl = DEFAULT_URL, api_key: ApiKey = "", limit: int = 20) -> None:
    with connect(api_url, api_key) as client:
        for j in call(client, "GET", "/v1/fine_tuning/jobs", params={"limit": limit})["data"]:
            typer.echo(f"{j['id']}  {j['status']:<16} {j['model']}  {j['fine_tuned_model'] or ''}")


@jobs_app.command("get")
def jobs_get(job_id: str, api_url: ApiUrl = DEFAULT_URL, api_key: ApiKey = "") -> None:
    with connect(api_url, api_key) as client:
        show(call(client, "GET", f"/v1/fine_tuning/jobs/{job_id}"))


def _action(action: str) -> Any:
    def command(job_id: str, api_url: ApiUrl = DEFAULT_URL, api_key: ApiKey = "") -> None:
        with connect(api_url, api_key) as client:
            job = call(client, "POST", f"/v1/fine_tuning/jobs/{job_id}/{action}")
            typer.echo(f"{job['id']} {job['status']}")

    command.__doc__ = f"{action.capitalize()} a job."
    return command


for _name in ("cancel", "pause", "resume"):
    jobs_app.command(_name)(_action(_name))


@jobs_app.command("events")
def jobs_events(
    job_id: str,
    api_url: ApiUrl = DEFAULT_URL,
    api_key: ApiKey = "",
    follow_: Annotated[bool, typer.Option("--follow", help="Live progress until it ends.")] = False,
    limit: int = 50,
) -> None:
    """A job's events; with --follow, a live progress bar (steps, loss, ETA)."""
    with connect(api_url, api_key) as client:
        if follow_:
            job = follow(client, job_id)
            typer.echo(f"{job['id']} {job['status']} {job['fine_tuned_model'] or ''}")
            return
        page = call(client, "GET", f"/v1/fine_tuning/jobs/{job_id}/events", params={"limit": limit})
        for ev in reversed(page["data"]):
            typer.echo(f"{ev['created_at']}  {ev['level']:<5} {ev['message']}")
