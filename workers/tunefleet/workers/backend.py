"""The Ray adapter: the only module that calls Ray's cluster, Jobs and Serve APIs.

A *run* is one Ray job (Jobs API) whose driver trains one fine-tuning job; its submission
id is ``{job_id}-{attempt}``, so a resubmission after a crash is idempotent. The same code
path serves a local Ray started in-process (embedded default) and a remote cluster.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tunefleet.platform.scheduler import Node, NodeType, replica_never_fits
from tunefleet.platform.serving_contract import app_name, route_prefix, serve_secret
from tunefleet.platform.settings import Settings
from tunefleet.platform.spec import INTEGRATION_ENV
from tunefleet.workers import _run_channel as run_channel

log = logging.getLogger(__name__)


# Ray job states, spelled as Ray spells them.
PENDING, RUNNING, SUCCEEDED, FAILED, STOPPED = (
    "PENDING",
    "RUNNING",
    "SUCCEEDED",
    "FAILED",
    "STOPPED",
)
NOT_FOUND = "NOT_FOUND"
TERMINAL_RAY = {SUCCEEDED, FAILED, STOPPED}


@dataclass(frozen=True)
class RunInfo:
    status: str
    message: str = ""


class RayBackend:
    """Connects to (or starts) Ray and submits, follows and stops runs; deploys Serve apps."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self._client: Any = None
        self._gcs_address = ""  # the cluster's, once connected: its runs are told it
        self._serve_started = False

    # -- cluster -----------------------------------------------------------------------
    def connect(self) -> None:
        import ray

        if ray.is_initialized():
            ctx = ray.get_runtime_context()
            dashboard = self.settings.ray_dashboard_url or _dashboard_of(ray)
            log.info("reusing Ray session %s", ctx.gcs_address)
        elif self.settings.ray_address:
            ray.init(address=self.settings.ray_address, log_to_driver=False)
            dashboard = self.settings.ray_dashboard_url or _dashboard_of(ray)
        else:
            stop_leftovers(self.settings.data_dir / EMBEDDED_MARKER)
            metrics: dict[str, Any] = {}
            if self.settings.ray_metrics_port is not None:
                metrics["_metrics_export_port"] = self.settings.ray_metrics_port
            with _environment_without(SECRET_ENV):  # Ray's processes inherit the rest
                info = ray.init(
                    # a new cluster of our own, never one a `ray start` or RAY_ADDRESS names
                    address="local",
                    **metrics,
                    num_cpus=self.settings.ray_num_cpus,
                    include_dashboard=True,
                    dashboard_host="127.0.0.1",
                    dashboard_port=self.settings.ray_dashboard_port,
                    log_to_driver=False,
                    # Runs get the same interpreter and packages as this process.
                    runtime_env={"env_vars": {"PYTHONUNBUFFERED": "1"}},
                )
            dashboard = f"http://{info.dashboard_url}"
            session_dir = info.address_info["session_dir"]  # type: ignore[attr-defined]
            note_session(self.settings.data_dir / EMBEDDED_MARKER, session_dir)
        from ray.job_submission import JobSubmissionClient

        self._client = JobSubmissionClient(dashboard)
        self._gcs_address = ray.get_runtime_context().gcs_address
        log.info("Ray Jobs API at %s, for the Ray cluster at %s", dashboard, self._gcs_address)

    def nodes(self) -> list[Node]:
        """The cluster's live nodes: total CPUs, GPUs and other resources, and what Ray has
        free on each now (anything else running on the cluster included)."""
        import ray

        try:  # the per-node view ray.util.tpu uses too; Ray has no public one
            from ray._private.state import available_resources_per_node

            available: dict[str, dict[str, float]] = available_resources_per_node()
        except Exception:  # an older or newer Ray without it: plan on totals alone
            log.warning("Ray's free resources per node are not available", exc_info=True)
            available = {}
        nodes = []
        for n in ray.nodes():
            if not n.get("Alive"):
                continue
            node_id, total = str(n["NodeID"]), n["Resources"]
            free = available.get(node_id)
            nodes.append(
                Node(
                    node_id,
                    float(total.get("CPU", 0.0)),
                    float(total.get("GPU", 0.0)),
                    free_cpus=None if free is None else float(free.get("CPU", 0.0)),
                    free_gpus=None if free is None else float(free.get("GPU", 0.0)),
                    resources=_custom(total),
                    free_resources=None if free is None else _custom(free),
                    memory=total.get("memory"),
                    labels=dict(n.get("Labels") or {}),
                )
            )
        return nodes

    def node_types(self) -> list[NodeType]:
        """The node types the cluster can add (``Settings.node_types``, else those Ray's
        autoscaler reported to the GCS, else none), each with its count of live nodes (by
        the node type Ray's autoscaler state names for each live node)."""
        import ray

        configured = [
            NodeType(t.name, t.cpus, t.gpus, dict(t.resources), t.max_count, 0, t.memory, t.labels)
            for t in self.settings.node_types
        ]
        if not configured:
            try:
                from ray._private.state import state

                config = state.get_cluster_config()
            except Exception:
                log.debug("Ray's cluster config is not available", exc_info=True)
                config = None
            for group in config.node_group_configs if config is not None else []:
                res = dict(group.resources)
                cpus, gpus = float(res.pop("CPU", 0)), float(res.pop("GPU", 0))
                configured.append(  # its proto has no labels
                    NodeType(
                        group.name, cpus, gpus, _custom(res), group.max_count, 0, res.get("memory")
                    )
                )
        if not configured:
            return []
        live: dict[str, int] = {}
        try:
            from ray.autoscaler.v2.sdk import get_cluster_status

            status = get_cluster_status(ray.get_runtime_context().gcs_address)
            for node in status.active_nodes + status.idle_nodes:
                live[node.ray_node_type_name] = live.get(node.ray_node_type_name, 0) + 1
        except Exception:  # counted as none up: a group at its limit is found out later
            log.warning("Ray's autoscaler state is not available", exc_info=True)
        return [replace(t, live=live.get(t.name, 0)) for t in configured]

    def draining_nodes(self) -> dict[str, float]:
        """Nodes being drained (a preemption notice, a pod terminating, a scale-down),
        with their deadline in seconds since the epoch (0: none)."""
        from ray._private.state import state

        return {str(k): v / 1000 for k, v in state.get_draining_nodes().items()}

    def request_capacity(self, bundles: list[dict[str, float]]) -> None:
        """Ask Ray's autoscaler to grow the cluster until ``bundles`` fit it at once (the
        request replaces the previous one; an empty list withdraws it)."""
        from ray.autoscaler.sdk import request_resources

        request_resources(bundles=bundles)

    # -- runs (Ray Jobs API) -----------------------------------------------------------
    def submit_run(self, submission_id: str, job_id: str, env: dict[str, str]) -> None:
        """Start the training driver for ``job_id``. Submitting an id that exists is a no-op."""
        if self.run_status(submission_id).status != NOT_FOUND:
            return
        try:
            self._client.submit_job(
                entrypoint=f"{sys.executable} -m tunefleet.workers.train.driver {job_id}",
                submission_id=submission_id,
                runtime_env={
                    "env_vars": {
                        **_passthrough_env(),
                        run_channel.CLUSTER_ENV: self._gcs_address,
                        **env,
                    }
                },
                metadata={"tunefleet_job_id": job_id},
                # off the head, where the autoscaler's ServiceAccount token is mounted
                entrypoint_resources=dict(self.settings.run_driver_resources) or None,
            )
        except RuntimeError as exc:  # submitted between the check and here: the same run
            if f"submission_id {submission_id} already exists" not in str(exc):
                raise

    def run_status(self, submission_id: str) -> RunInfo:
        try:
            info = self._client.get_job_info(submission_id)
        except RuntimeError as exc:  # the Jobs API answers 404 as a RuntimeError
            if "404" in str(exc) or "does not exist" in str(exc):
                return RunInfo(NOT_FOUND)
            raise
        return RunInfo(str(info.status.value), info.message or "")

    def run_logs_tail(self, submission_id: str, lines: int = 20) -> str:
        try:
            logs: str = self._client.get_job_logs(submission_id)
        except RuntimeError:
            return ""
        return "\n".join(logs.strip().splitlines()[-lines:])

    def stop_run(self, submission_id: str) -> None:
        try:
            self._client.stop_job(submission_id)
        except RuntimeError as exc:
            log.warning("stopping %s: %s", submission_id, exc)

    # -- run channels (workers/_run_channel.py) -----------------------------------------
    def open_channel(self, run_id: str, inputs: dict[str, Any]) -> None:
        run_channel.open_channel(run_id, inputs)

    def open_channels(self) -> list[str]:
        return run_channel.open_runs()

    def take(self, run_id: str) -> list[dict[str, Any]] | None:
        """What the run reported and was not acknowledged yet; None without a channel."""
        records: list[dict[str, Any]] | None = run_channel.call(run_id, "take")
        return records

    def ack(self, run_id: str, upto: int) -> None:
        run_channel.call(run_id, "ack", upto)

    def ask_stop(self, run_id: str, stop: dict[str, Any] | None) -> None:
        run_channel.call(run_id, "ask_stop", stop)

    def close_channel(self, run_id: str) -> None:
        run_channel.close_channel(run_id)

    # -- serving (Ray Serve) -----------------------------------------------------------
    def deploy_model_server(self, base_model: str, model_path: str) -> str:
        """Deploy (or keep) the Serve application for ``base_model``; returns its route.
        Refused (``ReplicaDoesNotFit``), before its application is deployed, where no node
        the cluster has or can add holds one of its replicas."""
        from ray import serve

        from tunefleet.workers.serve.app import ServingOptions, build_app, weights_bytes

        if not self._serve_started:
            serve.start(
                proxy_location=self.settings.serve_proxy_location,
                http_options={
                    "host": self.settings.serve_bind_host or self.settings.serve_host,
                    "port": self.settings.serve_port,
                },
            )
            self._serve_started = True
        name = app_name(base_model)
        prefix = route_prefix(base_model)
        status = serve.status().applications.get(name)
        if status is not None and str(status.status) in {"RUNNING", "ApplicationStatus.RUNNING"}:
            return prefix
        st = self.settings
        refused = replica_never_fits(
            base_model,
            weights_bytes(model_path),
            st.serve_adapter_memory,
            self.nodes(),
            self.node_types(),
        )
        if refused is not None:
            raise ReplicaDoesNotFit(refused)
        options = ServingOptions(
            max_adapters_per_replica=st.serve_max_adapters_per_replica,
            adapter_memory_bytes=st.serve_adapter_memory,
            max_batch_size=st.serve_max_batch_size,
            batch_wait_ms=st.serve_batch_wait_ms,
            base_quantization=st.serve_base_quantization,
            precision=st.serve_precision,
        )
        serve.run(
            build_app(
                base_model=base_model,
                model_path=model_path,
                store={
                    "location": st.artifact_location,
                    "endpoint_url": st.s3_endpoint_url,
                    "region": st.s3_region,
                },
                secret=serve_secret(st),
                options=options,
                min_replicas=st.serve_min_replicas,
                max_replicas=max(st.serve_min_replicas, st.serve_max_replicas),
                target_ongoing_requests=st.serve_target_ongoing_requests,
            ),
            name=name,
            route_prefix=prefix,
        )
        return prefix

    def push_serving_config(self, base_model: str, config: dict[str, list[str]]) -> list[Any]:
        """Tell every live replica of ``base_model``'s application which adapters to serve
        merged and which to keep pinned (``LoraServer.configure``); what each applied."""
        from ray import serve

        handle = serve.get_deployment_handle("LoraServer", app_name(base_model))
        results: list[Any] = handle.broadcast("configure", config).results(timeout_s=600)
        return results

    def prefetch_adapter(self, base_model: str, adapter_id: str, timeout_s: float) -> list[Any]:
        """Have every live replica of ``base_model``'s application copy the adapter to its
        node's cache now (``LoraServer.prefetch_now``); what each did."""
        from ray import serve

        handle = serve.get_deployment_handle("LoraServer", app_name(base_model))
        results: list[Any] = handle.broadcast("prefetch_now", adapter_id).results(
            timeout_s=timeout_s
        )
        return results

    def shutdown(self) -> None:
        import ray

        if ray.is_initialized():
            try:
                from ray import serve

                serve.shutdown()
            finally:
                ray.shutdown()


class ReplicaDoesNotFit(RuntimeError):
    """A base model's serving replica fits no node the cluster has or can add."""


# Resources every node has that no job asks for by name
_STANDARD = {"CPU", "GPU", "memory", "object_store_memory"}


def _custom(resources: dict[str, float]) -> dict[str, float]:
    """A node's resources other than CPU, GPU, memory and its ``node:<ip>`` marker."""
    return {
        k: float(v)
        for k, v in resources.items()
        if k not in _STANDARD and not k.startswith("node:")
    }


def _dashboard_of(ray: Any) -> str:
    url = (
        ray.get_runtime_context().get_dashboard_url()
        if hasattr(ray.get_runtime_context(), "get_dashboard_url")
        else ""
    )
    return url if url.startswith("http") else f"http://{url or '127.0.0.1:8265'}"


# The embedded Ray's processes carry this in their environment (inherited from the
# process that starts it, and passed on to runs): the id of the stack that started them.
EMBEDDED_ENV = "TUNEFLEET_EMBEDDED_RAY"
EMBEDDED_MARKER = "embedded-ray-id"


def stop_leftovers(marker: Path) -> list[int]:
    """Before an embedded Ray starts: kill what the previous one on this data folder left.

    A `tunefleet up` killed with SIGKILL cannot stop its Ray: its agents (holding the
    dashboard agent's fixed port, so that the next Ray's Jobs API has no agent) and a run's
    driver outlive it, the driver until it gives up on the dead GCS and records a failure
    on a job the next controller runs again. ``marker`` names the previous embedded Ray:
    the id its processes carry in ``TUNEFLEET_EMBEDDED_RAY`` and its session folder, which
    the processes that retitle themselves (and so hide their environment) hold files in.
    Those processes are killed and waited for; then a new id is set for the Ray about to
    start (``note_session`` adds its session folder). Returns the pids killed."""
    import secrets

    import psutil

    previous = json.loads(marker.read_text()) if marker.exists() else {}
    stack, session = previous.get("id"), previous.get("session_dir")
    found = []
    if stack or session:
        for proc in psutil.process_iter():
            try:
                if proc.pid == os.getpid():
                    continue
                if (stack and proc.environ().get(EMBEDDED_ENV) == stack) or (
                    session and any(f.path.startswith(session) for f in proc.open_files())
                ):
                    proc.kill()
                    found.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
    if found:
        psutil.wait_procs(found, timeout=10)  # their ports free before Ray starts again
        log.warning(
            "stopped %d process(es) a previous embedded Ray left: %s",
            len(found),
            [p.pid for p in found],
        )
    marker.parent.mkdir(parents=True, exist_ok=True)
    stack = secrets.token_hex(8)
    marker.write_text(json.dumps({"id": stack}))
    os.environ[EMBEDDED_ENV] = stack  # inherited by the Ray about to start
    return [p.pid for p in found]


def note_session(marker: Path, session_dir: str) -> None:
    """Record the embedded Ray's session folder next to its id (see ``stop_leftovers``)."""
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "session_dir": session_dir}))


# The settings a run reads (where artifacts and base models are), the fault tests' switch,
# and thread limits: what the driver must see as this process does. Nothing else of this
# process's environment goes (never a credential: Ray shows a run's environment).
RUN_ENV = (
    "TUNEFLEET_DATA_DIR",
    "TUNEFLEET_ARTIFACT_ROOT",
    "TUNEFLEET_MODEL_REGISTRY",
    "TUNEFLEET_FAILPOINT",
    "TUNEFLEET_OUTBOUND_ALLOW",
    EMBEDDED_ENV,
    "OMP_NUM_THREADS",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    *INTEGRATION_ENV,
)


# What only TuneFleet's own services hold: kept out of the embedded Ray's processes
# (replicas get the Serve secret as an argument).
SECRET_ENV = ("TUNEFLEET_DATABASE_URL", "TUNEFLEET_SERVE_SECRET")


@contextlib.contextmanager
def _environment_without(names: tuple[str, ...]) -> Iterator[None]:
    saved = {n: os.environ.pop(n) for n in names if n in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def _passthrough_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k in RUN_ENV}
