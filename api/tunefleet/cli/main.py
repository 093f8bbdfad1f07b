"""``tunefleet``: run the platform and administer it."""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import threading
from collections.abc import Iterator
from typing import Annotated, Any

import typer

from tunefleet.cli._client import adapters_app, files_app, jobs_app
from tunefleet.platform import audit
from tunefleet.platform.base_models import add_base_model, base_model_view, remove_base_model
from tunefleet.platform.db import session_scope
from tunefleet.platform.db.migrate import downgrade as db_downgrade
from tunefleet.platform.db.migrate import upgrade as db_upgrade
from tunefleet.platform.models import ModelRegistry
from tunefleet.platform.settings import get_settings
from tunefleet.platform.tenants import create_key, create_tenant

app = typer.Typer(help="TuneFleet: self-hosted fine-tuning.", no_args_is_help=True)
db_app = typer.Typer(help="Database migrations.", no_args_is_help=True)
models_app = typer.Typer(help="The base-model registry.", no_args_is_help=True)
admin_app = typer.Typer(help="Tenants, API keys and webhooks.", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(models_app, name="models")
app.add_typer(admin_app, name="admin")
app.add_typer(files_app, name="files")
app.add_typer(jobs_app, name="jobs")
app.add_typer(adapters_app, name="adapters")


@app.command()
def up(
    builtin_model: Annotated[bool, typer.Option(help="Prepare the built-in SmolLM2.")] = True,
) -> None:
    """Start everything on this machine: database, local Ray, controller, API, serving."""
    from tunefleet.cli._stack import running_stack

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    settings = get_settings()
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    with running_stack(settings, builtin_model=builtin_model) as stack:
        print(f"TuneFleet API at {stack.api_url}  (OpenAI base URL: {stack.api_url}/v1)")
        if stack.bootstrap_key:
            print("Created tenant 'default' with an admin API key (shown once):")
            print(f"  export OPENAI_API_KEY={stack.bootstrap_key}")
            print(f"  export OPENAI_BASE_URL={stack.api_url}/v1")
        print("Ready. Ctrl-C stops.", flush=True)
        done.wait()


@app.command()
def api(
    workers: Annotated[int, typer.Option(min=1, help="API worker processes.")] = 1,
) -> None:
    """Run only the REST API on TUNEFLEET_API_HOST:TUNEFLEET_API_PORT, against
    TUNEFLEET_DATABASE_URL, the artifact store and the Serve proxy at
    TUNEFLEET_SERVE_HOST:PORT (with TUNEFLEET_SERVE_SECRET). Stateless: run as many as
    the load needs. Probes: /healthz (alive), /readyz (database and Ray reachable)."""
    import os
    import tempfile

    import uvicorn

    from tunefleet.api import server_options

    settings = get_settings()
    if workers > 1:  # one /metrics for all workers (prometheus_client's multiprocess mode)
        os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", tempfile.mkdtemp(prefix="tf-prom-"))
    uvicorn.run(
        "tunefleet.api.app:create_app",
        factory=True,
        host=settings.api_host,
        port=settings.api_port,
        workers=workers,
        **server_options(settings),
    )


@app.command()
def controller(
    health_port: Annotated[
        int | None, typer.Option(help="Serve GET /healthz on this port (0.0.0.0).")
    ] = None,
) -> None:
    """Run only the controller against TUNEFLEET_DATABASE_URL and the Ray cluster at
    TUNEFLEET_RAY_ADDRESS (a local Ray when unset). Start several for high availability:
    one leads through the database lease, the others stand by. /healthz answers 200 while
    its loop goes round, with whether it leads and its term."""
    from tunefleet.platform.db.migrate import upgrade_unless_newer
    from tunefleet.platform.lease import Lease
    from tunefleet.workers.backend import RayBackend
    from tunefleet.workers.controller import Controller

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    settings = get_settings()
    if warning := upgrade_unless_newer(settings.resolved_database_url):
        logging.getLogger("tunefleet.controller").warning(warning)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    backend = RayBackend(settings)
    backend.connect()
    lease = Lease(settings.resolved_database_url, ttl_s=settings.controller_lease_ttl_s)
    ctl = Controller(settings, backend, lease=lease)
    if health_port is not None:
        serve_health(health_port, ctl.health)
    print(f"controller {lease.holder} started", flush=True)
    ctl.run_forever(done)


def serve_health(port: int, health: Any) -> Any:
    """GET /healthz (200 or 503 with ``health()``'s details) and /metrics (Prometheus, for
    a bearer of ``TUNEFLEET_METRICS_TOKEN`` when set) on ``port``, in a thread; returns
    the server (``shutdown()`` stops it)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from tunefleet.platform.metrics import exposition, scrape_allowed

    settings = get_settings()
    db_url = settings.resolved_database_url

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/metrics" and not scrape_allowed(
                settings.metrics_token, self.headers.get("Authorization")
            ):
                status, content_type = 401, "application/json"
                body = b'{"error": "/metrics needs the metrics token as a bearer token"}'
            elif self.path == "/metrics":
                body, content_type = exposition(db_url)
                status = 200
            elif self.path == "/healthz":
                healthy, details = health()
                status = 200 if healthy else 503
                body = json.dumps({"status": "ok" if healthy else "unhealthy", **details}).encode()
                content_type = "application/json"
            else:
                status, body, content_type = 404, b"{}", "application/json"
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: Any) -> None:  # probes every few seconds: not logged
            pass

    server = ThreadingHTTPServer(("0.0.0.0", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True, name="health").start()
    return server


@app.command()
def demo(
    questions: Annotated[
        int | None, typer.Option(min=1, help="Held-out questions to ask (default: all).")
    ] = None,
) -> None:
    """Fine-tune the built-in model on the bundled dataset and compare answers."""
    from tunefleet.cli._demo import run_demo

    run_demo(get_settings(), questions=questions)


@app.command()
def plan(
    model: str,
    options: Annotated[
        str | None,
        typer.Option(help='TuneFleet controls as JSON, as in a job, e.g. \'{"lora": {"r": 16}}\''),
    ] = None,
    batch_size: int = 4,
    device_memory_gb: Annotated[float | None, typer.Option()] = None,
    host_memory_gb: Annotated[float | None, typer.Option()] = None,
) -> None:
    """Print the memory plan of a job on MODEL (a registry name or a config.json path)."""
    from pathlib import Path

    from pydantic import ValidationError

    from tunefleet.cli._plan_table import render
    from tunefleet.platform.errors import TuneFleetError
    from tunefleet.platform.jobs import JobCreateRequest, dry_run
    from tunefleet.platform.planner import PlanDevice

    settings = get_settings()
    registry = ModelRegistry(settings.resolved_model_registry)
    path = Path(model)
    try:
        config = (
            json.loads(path.read_text())
            if path.suffix == ".json" and path.is_file()
            else registry.config(registry.require(model).name)
        )
        req = JobCreateRequest.model_validate(
            {
                "model": model,
                "training_file": "-",
                "seed": 0,
                "hyperparameters": {"n_epochs": 1, "batch_size": batch_size},
                "tunefleet": json.loads(options) if options else {},
            }
        )
        device = PlanDevice.from_gb(
            device_memory_gb or settings.device_memory_gb,
            host_memory_gb or settings.host_memory_gb,
        )
        result = dry_run(req, config, tenant_id="cli", device=device)
    except (TuneFleetError, ValidationError, ValueError) as exc:  # bad input: say it, no trace
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    typer.echo(render(result))


@db_app.command("upgrade")
def upgrade(revision: str = "head") -> None:
    """Apply migrations up to REVISION (default: the newest)."""
    db_upgrade(get_settings().resolved_database_url, revision)
    typer.echo(f"database at revision {revision}")


@db_app.command("downgrade")
def downgrade(revision: str) -> None:
    """Revert migrations down to REVISION."""
    db_downgrade(get_settings().resolved_database_url, revision)


@models_app.command("prepare")
def models_prepare() -> None:
    """Convert the built-in SmolLM2-135M-Instruct GGUF into the registry (once)."""
    from tunefleet.workers.model_registry import prepare_builtin

    typer.echo(prepare_builtin(ModelRegistry(get_settings().resolved_model_registry)))


@models_app.command("list")
def models_list(
    details: Annotated[
        bool, typer.Option("--json", help="Print each model's check as JSON lines.")
    ] = False,
) -> None:
    """List the base models in the registry."""
    registry = ModelRegistry(get_settings().resolved_model_registry)
    for name in registry.names():
        typer.echo(json.dumps(base_model_view(registry, name)) if details else name)


@models_app.command("add")
def models_add(
    name: str,
    source: Annotated[
        str, typer.Argument(help="A model folder on this machine, or s3:// in the store.")
    ],
    chat_template: Annotated[
        typer.FileText | None,
        typer.Option(help="A Jinja chat template file, for a model whose folder has none."),
    ] = None,
) -> None:
    """Check a model (config and weights agree, a supported architecture, a tokenizer, a
    chat template) and copy it into the registry as NAME; prints what it holds as JSON."""
    from tunefleet.platform.artifacts import artifact_store

    settings = get_settings()
    with _admin_session() as s:
        view = add_base_model(
            s,
            ModelRegistry(settings.resolved_model_registry),
            artifact_store(settings),
            name,
            source,
            actor=audit.CLI,
            chat_template=chat_template.read() if chat_template else None,
            any_path=True,
        )
    typer.echo(json.dumps(view))


@models_app.command("remove")
def models_remove(name: str) -> None:
    """Remove base model NAME, refused while an unfinished job or an adapter uses it."""
    settings = get_settings()
    with _admin_session() as s:
        remove_base_model(s, ModelRegistry(settings.resolved_model_registry), name, actor=audit.CLI)
    typer.echo(f"removed {name}")


@admin_app.command("create-tenant")
def admin_create_tenant(
    name: str,
    max_concurrent_jobs: int = 4,
    max_gpus: int = 8,
    max_waiting_jobs: Annotated[
        int, typer.Option(help="Jobs validating or queued at once; one more answers 429.")
    ] = 100,
    with_key: Annotated[bool, typer.Option(help="Also create an API key.")] = True,
) -> None:
    """Create a tenant (and a key for it); prints JSON with the key, shown once."""
    with session_scope(get_settings().resolved_database_url) as s:
        tenant = create_tenant(
            s,
            name,
            max_concurrent_jobs=max_concurrent_jobs,
            max_gpus=max_gpus,
            max_waiting_jobs=max_waiting_jobs,
            actor=audit.CLI,
        )
        out = {"tenant_id": tenant.id, "name": tenant.name}
        if with_key:
            key, plaintext = create_key(s, tenant.id, name="initial", actor=audit.CLI)
            out |= {"key_id": key.id, "api_key": plaintext}
    typer.echo(json.dumps(out))


@admin_app.command("create-key")
def admin_create_key(
    tenant: str,
    admin: Annotated[bool, typer.Option(help="Key opens cross-tenant admin routes.")] = False,
    name: str = "",
) -> None:
    """Create an API key for TENANT (name or id); prints JSON with the key, shown once."""
    with session_scope(get_settings().resolved_database_url) as s:
        tenant_id = _tenant_id(s, tenant)
        key, plaintext = create_key(s, tenant_id, name=name, is_admin=admin, actor=audit.CLI)
        typer.echo(
            json.dumps(
                {
                    "tenant_id": tenant_id,
                    "key_id": key.id,
                    "prefix": key.prefix,
                    "api_key": plaintext,
                }
            )
        )


def _tenant_id(s: Any, tenant: str) -> str:
    """The id of the tenant named or numbered ``tenant`` (a CLI error naming it if none)."""
    from sqlalchemy import or_, select

    from tunefleet.platform.db import Tenant

    row = s.scalar(select(Tenant).where(or_(Tenant.name == tenant, Tenant.id == tenant)))
    if row is None:
        raise typer.BadParameter(
            f"no tenant {tenant!r}; create it with `tunefleet admin create-tenant`"
        )
    return str(row.id)


@contextlib.contextmanager
def _admin_session() -> Iterator[Any]:
    """A session for an admin command; a refusal (bad URL, unknown id) is the command's
    error, naming the value, not a traceback."""
    from tunefleet.platform.errors import TuneFleetError

    try:
        with session_scope(get_settings().resolved_database_url) as s:
            yield s
    except TuneFleetError as exc:
        raise typer.BadParameter(exc.message) from None


@admin_app.command("create-webhook")
def admin_create_webhook(
    tenant: str,
    url: str,
    event: Annotated[
        list[str] | None,
        typer.Option(help="An event to send (repeat for more); all of them when left out."),
    ] = None,
    description: str = "",
) -> None:
    """Send TENANT's jobs' ends to URL, signed per Standard Webhooks; prints JSON with the
    signing secret, shown once."""
    from tunefleet.platform import webhooks

    with _admin_session() as s:
        endpoint = webhooks.add_endpoint(
            s,
            _tenant_id(s, tenant),
            url,
            events=event,
            description=description,
            policy=get_settings().outbound_policy,
            actor=audit.CLI,
        )
        typer.echo(json.dumps(webhooks.endpoint_view(endpoint, with_secret=True)))


@admin_app.command("list-webhooks")
def admin_list_webhooks(tenant: str) -> None:
    """TENANT's webhook endpoints, one JSON object a line (no secrets)."""
    from tunefleet.platform import webhooks

    with _admin_session() as s:
        for endpoint in webhooks.list_endpoints(s, _tenant_id(s, tenant)):
            typer.echo(json.dumps(webhooks.endpoint_view(endpoint)))


@admin_app.command("delete-webhook")
def admin_delete_webhook(endpoint_id: str) -> None:
    """Delete a webhook endpoint and its deliveries."""
    from tunefleet.platform import webhooks

    with _admin_session() as s:
        webhooks.remove_endpoint(s, endpoint_id, actor=audit.CLI)
    typer.echo(json.dumps({"id": endpoint_id, "object": "webhook_endpoint", "deleted": True}))


@admin_app.command("webhook-deliveries")
def admin_webhook_deliveries(endpoint_id: str, limit: int = 20) -> None:
    """An endpoint's delivery log, newest first, one JSON object a line."""
    from tunefleet.platform import webhooks

    with _admin_session() as s:
        for delivery in webhooks.deliveries(s, endpoint_id, limit):
            typer.echo(json.dumps(webhooks.delivery_view(delivery)))


if __name__ == "__main__":
    app()
