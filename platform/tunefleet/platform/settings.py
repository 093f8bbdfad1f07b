"""Process settings, read from the environment (prefix ``TUNEFLEET_``) behind ``get_settings()``.

Nothing here is built at import time: call ``get_settings()`` where a value is needed, and
``get_settings.cache_clear()`` in tests that change the environment.
"""

from __future__ import annotations

import os
import string
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from tunefleet.platform.outbound import OutboundPolicy
from tunefleet.platform.spec import TrackingSpaces


class NodeTypeSetting(BaseModel):
    """A kind of node the Ray cluster can add (a KubeRay worker group): what one node
    has and how many the group may hold."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=63, description="The group's name.")
    cpus: float = Field(ge=0, description="CPUs of one node.")
    gpus: float = Field(default=0, ge=0, description="GPUs of one node.")
    resources: dict[str, float] = Field(
        default_factory=dict, description="Its other Ray resources (custom, accelerator type)."
    )
    max_count: int = Field(default=-1, ge=-1, description="Most nodes of the group (-1: no limit).")
    memory: int | None = Field(
        default=None,
        gt=0,
        description="Ray memory of one node, in bytes or as a Kubernetes quantity (a "
        "KubeRay pod's memory limit, 16Gi); None: not known.",
    )
    labels: dict[str, str] = Field(
        default_factory=dict,
        description="Its nodes' Ray labels (tunefleet.io/role: training keeps replicas off).",
    )

    @field_validator("memory", mode="before")
    @classmethod
    def _quantity(cls, v: object) -> object:
        return parse_quantity(v) if isinstance(v, str) else v


class Settings(BaseSettings):
    """Every knob a TuneFleet process reads. Each field maps to ``TUNEFLEET_<NAME>``."""

    model_config = SettingsConfigDict(env_prefix="TUNEFLEET_", extra="ignore", frozen=True)

    data_dir: Path = Field(
        default=Path(".data"),
        description="Root for the embedded defaults: SQLite file, artifacts, model registry.",
    )
    database_url: str = Field(
        default="",
        description="SQLAlchemy URL. Empty means a SQLite file `tunefleet.db` in data_dir.",
    )
    artifact_root: str = Field(
        default="",
        description="Where uploads, checkpoints, adapters and merged models live: a local "
        "folder (shared by every node: a ReadWriteMany volume) or s3://bucket/prefix "
        "(credentials from the AWS_* environment). Empty: data_dir/artifacts.",
    )
    s3_endpoint_url: str = Field(
        default="",
        description="S3 endpoint for s3:// artifact roots other than AWS's (MinIO, GCS's "
        "interoperability endpoint), e.g. http://minio:9000.",
    )
    s3_region: str = Field(default="", description="S3 region (empty: us-east-1).")
    artifact_cache: Path | None = Field(
        default=None,
        description="Where the processes of a node keep their copies of artifacts from "
        "object storage (training files, adapters), this user's alone. Default: "
        "tunefleet-artifact-cache-UID in the system's temporary folder.",
    )
    artifact_cache_size: int = Field(
        default=20 << 30,
        gt=0,
        description="The space the node's artifact cache may use, in bytes or as a "
        "Kubernetes quantity (20Gi, 500Mi): the chart's artifacts.cacheSize, its volume. "
        "Copies are evicted, least recently used first and never while in use, to keep "
        "them within 90% of it (the rest is for uploads and downloads in flight).",
    )
    model_cache: Path | None = Field(
        default=None,
        description="Where the processes of a node keep their copies of base models from the "
        "registry, this user's alone (with model_cache_size set). Default: "
        "tunefleet-model-cache-UID in the system's temporary folder.",
    )
    model_cache_size: int = Field(
        default=0,
        ge=0,
        description="The space the node's model cache may use, in bytes or as a Kubernetes "
        "quantity (the chart's models.nodeCacheSize, its volume): replicas and training "
        "workers then load base models from a copy on the node, made once per node and "
        "evicted least recently used first (never while a replica uses it), instead of "
        "from the registry's shared volume. 0: models are read from the registry in place.",
    )
    model_registry: Path | None = Field(
        default=None,
        description="Folder of base models in safetensors form, one sub-folder each. "
        "Default data_dir/models.",
    )
    model_import_dir: Path | None = Field(
        default=None,
        description="A folder the admin API may add base models from (a mounted volume "
        "of model folders): `POST /v1/admin/base_models` takes local paths inside it only. "
        "None: the API adds from object storage only (`tunefleet models add` on the "
        "machine takes any folder).",
    )
    python_graders: bool = Field(
        default=False,
        description="Run tenants' python graders (in platform/sandbox.py's child process: "
        "limits, no network, Landlock; refused where the kernel has no Landlock).",
    )
    python_grader_cpu_s: int = Field(
        default=5, ge=1, le=600, description="CPU seconds of one python grade (wall: 2x + 1)."
    )
    python_grader_memory_mb: int = Field(
        default=1024, ge=64, le=65536, description="Address space of one python grade (MiB)."
    )
    adapter_max_rank: int = Field(
        default=256,
        ge=1,
        le=1024,
        description="The highest LoRA rank an imported adapter may have (`POST /v1/models`).",
    )
    ray_address: str = Field(
        default="",
        description="Ray cluster to use (`auto` or host:port). Empty starts a local one.",
    )
    ray_dashboard_url: str = Field(
        default="",
        description="Ray Jobs API base URL. Empty: the local cluster's dashboard.",
    )
    ray_dashboard_port: int = Field(
        default=8265, description="Dashboard (Jobs API) port of a locally started Ray."
    )
    ray_metrics_port: int | None = Field(
        default=None,
        description="Prometheus metrics port of a locally started Ray, where serving's "
        "per-adapter metrics appear (None: Ray picks one).",
    )
    ray_num_cpus: int | None = Field(
        default=None, description="Logical CPUs of a locally started Ray (None: Ray's own count)."
    )
    api_host: str = Field(default="127.0.0.1", description="Address the REST API binds to.")
    api_port: int = Field(default=8080, description="Port the REST API listens on.")
    metrics_token: str = Field(
        default="",
        repr=False,
        description="A bearer token every scrape of /metrics (the API's, the controller's "
        "health port's) must send; empty: /metrics is open to whoever reaches the port.",
    )
    forwarded_allow_ips: str = Field(
        default="127.0.0.1",
        description="Proxies whose X-Forwarded-For and X-Forwarded-Proto the API believes "
        "(uvicorn's forwarded_allow_ips: addresses and CIDRs, comma-separated, or '*'): a "
        "request through one of them has the client's address and scheme, so a dashboard "
        "session cookie over https is Secure. The chart sets its ingress's.",
    )
    serve_host: str = Field(
        default="127.0.0.1", description="Ray Serve HTTP proxy host, as the API reaches it."
    )
    serve_bind_host: str = Field(
        default="",
        description="Address Serve's HTTP proxies bind to on their Ray node (0.0.0.0 in a "
        "cluster, where the API reaches the head by a service name). Empty: serve_host.",
    )
    serve_port: int = Field(default=8000, description="Ray Serve HTTP proxy port.")
    serve_proxy_location: Literal["HeadOnly", "EveryNode"] = Field(
        default="HeadOnly",
        description="Where Serve's HTTP proxies run: the head alone (one address for the "
        "API to call) or every node with a replica.",
    )
    serve_secret: str = Field(
        default="",
        repr=False,
        description="Shared secret the API sends Serve with every request; Serve refuses "
        "requests without it. Empty: one is made once in data_dir/serve-secret (the "
        "embedded default); set it (the same value) on the API and the controller in a "
        "cluster.",
    )
    serve_max_adapters_per_replica: int = Field(
        default=64, ge=1, le=1024, description="Adapters one serving replica holds (LRU)."
    )
    serve_adapter_memory: int = Field(
        default=4 << 30,
        gt=0,
        description="The memory one serving replica's adapters may take, in bytes or as a "
        "Kubernetes quantity (4Gi, 512Mi): the chart's serve.adapterMemory. An adapter "
        "takes its rank (rounded up to a power of two) times the sizes of the layers it "
        "targets, in float32; the least recently used unpinned ones are evicted to keep "
        "within it, and one larger than all of it is refused (serve it merged).",
    )
    serve_max_batch_size: int = Field(
        default=32, ge=1, le=1024, description="Requests decoded together per replica."
    )
    serve_batch_wait_ms: float = Field(
        default=5, ge=0, le=1000, description="How long an idle replica waits to batch."
    )
    serve_base_quantization: Literal["none", "nf4"] = Field(
        default="none",
        description="Serve the base in fp32 ('none') or 4-bit NF4 ('nf4', for QLoRA "
        "adapters on the base they were trained on).",
    )
    serve_precision: Literal["auto", "fp32", "bf16"] = Field(
        default="auto",
        description="What replicas serve the base in: 'auto' is bf16 where the replica's "
        "CPU computes bf16 natively (AMX or AVX512-BF16, as training's 'auto'), else fp32.",
    )
    serve_min_replicas: int = Field(default=1, ge=1, description="Serving replicas (least).")
    serve_max_replicas: int = Field(
        default=1, ge=1, description="Serving replicas (most; above the least: autoscaling)."
    )
    serve_target_ongoing_requests: float = Field(
        default=16, gt=0, description="Autoscaling target of ongoing requests per replica."
    )
    serve_config_push_s: float = Field(
        default=2,
        gt=0,
        description="How often the controller pushes which adapters are merged or pinned to "
        "every serving replica (a change goes at once; a new replica learns it within this).",
    )
    serve_warm_adapters: int = Field(
        default=8,
        ge=0,
        description="How many of a base model's adapters most requested in the last hour a "
        "starting serving replica loads before it takes traffic (0: none).",
    )
    max_upload_bytes: int = Field(
        default=512 * 1024 * 1024, gt=0, description="Largest accepted file upload, in bytes."
    )
    # The largest real control body (a job with 16 metadata pairs and every tunefleet
    # option) is a few KiB: 1 MiB leaves wide room and bounds what one request can make
    # the API parse and hold.
    max_json_body_bytes: int = Field(
        default=1024 * 1024,
        gt=0,
        description="Largest JSON body of a control route (jobs, plans, models, admin), "
        "in bytes; counted while the body is read.",
    )
    # A chat request carries its whole conversation: a 128k-token context is ~512 KB of
    # text, up to ~3 MB once JSON escapes non-ASCII characters (\uXXXX); 8 MiB holds that
    # and a list of prompts to /v1/completions.
    max_inference_body_bytes: int = Field(
        default=8 * 1024 * 1024,
        gt=0,
        description="Largest body of /v1/chat/completions and /v1/completions, in bytes.",
    )
    inference_requests_per_s: float = Field(
        default=20.0,
        ge=0,
        le=1000,
        description="Each tenant's inference requests per second (chat and completions, "
        "every API replica together; bursts of one second's worth), unless an admin set "
        "the tenant its own. 0: no limit. Over it: 429 with Retry-After.",
    )
    inference_concurrent_requests: int = Field(
        default=16,
        ge=0,
        description="Each tenant's inference requests in flight at once (every API "
        "replica together), unless an admin set the tenant its own. 0: no limit.",
    )
    node_types: tuple[NodeTypeSetting, ...] = Field(
        default=(),
        description="The node types the Ray cluster's autoscaler can add, a JSON list of "
        '{"name", "cpus", "gpus", "resources", "max_count", "memory", "labels"} (the chart '
        "renders it from its worker groups). Empty: those Ray's autoscaler reports, if "
        "any; without either, jobs are planned on the live nodes alone.",
    )
    capacity_wait_s: float = Field(
        default=1800,
        gt=0,
        description="How long a job waits for the autoscaler to add the nodes it needs "
        "before it fails with capacity_timeout.",
    )
    run_driver_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Ray resources a run's driver asks for (Ray Jobs' entrypoint_resources), "
        'a JSON object, e.g. {"tunefleet-driver": 1}: drivers then run only on nodes that '
        "advertise them, never on the head with the autoscaler's ServiceAccount token.",
    )
    device_memory_gb: float = Field(
        default=80, description="Accelerator memory per worker the planner plans for (GiB)."
    )
    host_memory_gb: float = Field(
        default=256, description="Host memory per worker available to CPU offload (GiB)."
    )
    controller_interval_s: float = Field(
        default=0.5, description="Seconds between two passes of the controller loop."
    )
    controller_lease_ttl_s: float = Field(
        default=15,
        description="Seconds a controller's leadership lasts unless renewed (every pass); "
        "a standby controller takes over this long after the leader dies.",
    )
    webhook_retry_delays_s: tuple[Annotated[float, Field(ge=0, le=7 * 86400)], ...] = Field(
        default=(5, 300, 1800, 7200, 18000, 36000),
        max_length=20,
        description="Seconds before each retry of a webhook delivery that did not get a 2xx "
        "(Standard Webhooks' schedule: 5 s, 5 min, 30 min, 2 h, 5 h, 10 h); after the last, "
        "the delivery is marked failed. A JSON list in the environment.",
    )
    webhook_timeout_s: float = Field(
        default=15, gt=0, le=300, description="Seconds a webhook endpoint has to answer."
    )
    outbound_allow: tuple[str, ...] = Field(
        default=(),
        max_length=100,
        description="Where outbound requests that tenants address (webhooks, MLflow tracking "
        "servers) may go besides public addresses: host names, or CIDRs such as "
        "10.0.0.0/8 for an internal MLflow. Loopback, private, link-local (the cloud's "
        "metadata service) and other non-public addresses are refused otherwise. A JSON "
        "list in the environment.",
    )

    mlflow_experiment_template: str = Field(
        default="{tenant}/{experiment}",
        max_length=256,
        description="The MLflow experiment a tenant's job writes to on the operator's "
        "tracking server (MLFLOW_TRACKING_URI): {tenant} is the tenant's name, {experiment} "
        "the job's experiment_name. Must hold {tenant}: tenants share the server's "
        "experiments otherwise.",
    )
    wandb_entity_template: str = Field(
        default="",
        max_length=128,
        description="The W&B entity (team) of tenants' runs, e.g. {tenant} for a team per "
        "tenant; empty: the W&B key's default entity. A job's own entity is refused unless "
        "it is this one.",
    )
    wandb_project_template: str = Field(
        default="{tenant}-{project}",
        max_length=128,
        description="The W&B project of a tenant's runs, {project} the job's. The entity or "
        "the project template must hold {tenant}.",
    )

    @model_validator(mode="after")
    def _tracking_templates(self) -> Settings:
        templates = {
            "TUNEFLEET_MLFLOW_EXPERIMENT_TEMPLATE": (self.mlflow_experiment_template, "experiment"),
            "TUNEFLEET_WANDB_ENTITY_TEMPLATE": (self.wandb_entity_template, None),
            "TUNEFLEET_WANDB_PROJECT_TEMPLATE": (self.wandb_project_template, "project"),
        }
        for name, (template, field) in templates.items():
            fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
            allowed = {"tenant"} | ({field} if field else set())
            if not fields <= allowed:
                raise ValueError(
                    f"{name} {template!r} may hold only "
                    + " and ".join(f"{{{f}}}" for f in sorted(allowed))
                )
        if "{tenant}" not in self.mlflow_experiment_template:
            raise ValueError(
                "TUNEFLEET_MLFLOW_EXPERIMENT_TEMPLATE must hold {tenant}: tenants would write "
                "into each other's experiments"
            )
        if "{tenant}" not in self.wandb_entity_template + self.wandb_project_template:
            raise ValueError(
                "TUNEFLEET_WANDB_ENTITY_TEMPLATE or TUNEFLEET_WANDB_PROJECT_TEMPLATE must hold "
                "{tenant}: tenants would write into each other's projects"
            )
        return self

    @property
    def tracking_spaces(self) -> TrackingSpaces:
        return TrackingSpaces(
            self.mlflow_experiment_template, self.wandb_entity_template, self.wandb_project_template
        )

    @field_validator(
        "artifact_cache_size", "model_cache_size", "serve_adapter_memory", mode="before"
    )
    @classmethod
    def _quantity(cls, v: object) -> object:
        return parse_quantity(v) if isinstance(v, str) else v

    @field_validator("outbound_allow")
    @classmethod
    def _outbound_allow(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        OutboundPolicy.from_allow(v)  # names a bad entry
        return v

    # -- the dashboard (tunefleet.api.ui) ------------------------------------------------
    ui_secret: str = Field(
        default="",
        repr=False,
        description="Key that signs the dashboard's session cookies; the same on every API "
        "process behind one address. Empty: one is made once in data_dir/ui-secret (mode "
        "0600), so restarts keep sessions. Changing it signs everyone out.",
    )
    ui_session_hours: float = Field(
        default=12,
        gt=0,
        le=24 * 30,
        description="How long a dashboard sign-in lasts before the key must be entered again.",
    )

    @property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'tunefleet.db').resolve()}"

    @property
    def artifact_location(self) -> str:
        """The artifact store: its s3:// URL, or its local folder's absolute path."""
        if self.artifact_root.startswith("s3://"):
            return self.artifact_root
        return str(self.resolved_artifact_root)

    @property
    def resolved_artifact_root(self) -> Path:
        """The local artifact folder; an s3:// artifact root has none (``artifact_location``
        names either, ``artifacts.artifact_store`` opens either)."""
        if self.artifact_root.startswith("s3://"):
            raise ValueError(
                f"the artifact root {self.artifact_root} is object storage, not a folder; "
                "open it with tunefleet.platform.artifacts.artifact_store"
            )
        return Path(self.artifact_root or self.data_dir / "artifacts").resolve()

    @property
    def resolved_artifact_cache(self) -> Path:
        default = Path(tempfile.gettempdir()) / f"tunefleet-artifact-cache-{os.getuid()}"
        return (self.artifact_cache or default).resolve()

    @property
    def resolved_model_cache(self) -> Path:
        default = Path(tempfile.gettempdir()) / f"tunefleet-model-cache-{os.getuid()}"
        return (self.model_cache or default).resolve()

    @property
    def resolved_model_registry(self) -> Path:
        return (self.model_registry or self.data_dir / "models").resolve()

    @property
    def resolved_ray_dashboard_url(self) -> str:
        """Ray's dashboard (its Jobs API and state endpoints), as the API reaches it."""
        return self.ray_dashboard_url or f"http://127.0.0.1:{self.ray_dashboard_port}"

    @property
    def outbound_policy(self) -> OutboundPolicy:
        return OutboundPolicy.from_allow(self.outbound_allow)

    @property
    def serve_url(self) -> str:
        return f"http://{self.serve_host}:{self.serve_port}"


_QUANTITY_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
                   "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}  # fmt: skip


def parse_quantity(text: str) -> int:
    """Bytes from a Kubernetes quantity of bytes (``20Gi``, ``500M``, ``1048576``)."""
    number = text.strip().rstrip("KMGTik")
    unit = text.strip()[len(number) :]
    try:
        if unit not in _QUANTITY_UNITS:
            raise ValueError(unit)
        return int(float(number) * _QUANTITY_UNITS[unit])
    except ValueError:
        raise ValueError(
            f"{text!r} is not a size: give bytes, or a number with one of "
            f"{', '.join(u for u in _QUANTITY_UNITS if u)} (20Gi, 500Mi)"
        ) from None


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read once from the environment."""
    return Settings()
