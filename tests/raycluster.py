"""A Ray cluster the test session starts and owns: ``ray start --head --block`` in a process
group of its own, every port chosen free, its own temp dir, the session's auth token.

Nothing here attaches to a cluster it did not start, and stopping signals only the
cluster's own process group (never ``ray stop``, which ends every Ray of the user on the
machine: a ``tunefleet up`` someone has running, a benchmark, another suite).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Ray's CLI beside this interpreter, else its module (Ray installed with pip --target, as
# bench/gpu_check.py --site does, has no script for this interpreter)
_SCRIPT = Path(sys.executable).parent / "ray"
RAY = (str(_SCRIPT),) if _SCRIPT.exists() else (sys.executable, "-m", "ray.scripts.scripts")


_GIVEN: set[int] = set()


def free_port() -> int:
    """A port nothing listens on now, and never one this process was given before: the
    kernel hands a just-closed port out again, and one `ray start` given the same port for
    two of its components exits ("... is trying to use a port number 50349 that is used by
    other components", a CI run's)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


@dataclass(frozen=True)
class RayCluster:
    address: str  # GCS, for ray.init(address=...) and TUNEFLEET_RAY_ADDRESS
    dashboard: str  # Jobs API base URL, for TUNEFLEET_RAY_DASHBOARD_URL
    metrics_port: int  # Prometheus export port (Serve's per-adapter metrics)
    temp_dir: Path
    pid: int  # of `ray start --block`, the leader of the cluster's process group

    def env(self) -> dict[str, str]:
        """The settings that point a TuneFleet process at this cluster."""
        return {
            "TUNEFLEET_RAY_ADDRESS": self.address,
            "TUNEFLEET_RAY_DASHBOARD_URL": self.dashboard,
        }


def _wait_listening(ports: list[int], proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 120
    pending = list(ports)
    while pending:
        if proc.poll() is not None:
            raise RuntimeError(f"ray start exited {proc.returncode}:\n{log.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"Ray ports {pending} never listened:\n{log.read_text()[-4000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", pending[0])) == 0:
                pending.pop(0)
                continue
        time.sleep(0.2)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_group(pgid: int, grace_s: float = 3) -> None:
    """SIGTERM the process group ``pgid`` (and only it), SIGKILL what is left after
    ``grace_s``.

    A short grace is enough: Ray's processes, signalled all at once, wait on each other
    (GCS, raylets and the autoscaler's monitor were all still there 7 s after SIGTERM, and
    every cluster's stop took the whole 15 s of the old grace), and a test's cluster keeps
    nothing that a graceful stop would save (its own temp dir, its own ports)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = 30) -> None:
    """SIGTERM the process group ``proc`` leads (started with ``start_new_session``),
    SIGKILL it after ``grace_s``; ``proc`` is reaped."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _node_ports() -> list[str]:
    """Every port a node opens, of its own (see ``ray_cluster``)."""
    return [
        *("--dashboard-agent-grpc-port", str(free_port())),
        *("--runtime-env-agent-port", str(free_port())),
        *("--node-manager-port", str(free_port())),
        *("--object-manager-port", str(free_port())),
    ]


@contextlib.contextmanager
def ray_cluster(
    num_cpus: int, resources: str = "", node_types: dict[str, Any] | None = None
) -> Iterator[RayCluster]:
    """Start a one-node cluster of ``num_cpus`` logical CPUs (and custom ``resources``, a
    JSON object); stop its process group on exit.

    With ``node_types`` (the autoscaler's ``available_node_types`` for worker nodes), the
    head runs Ray's own autoscaler over its fake multi-node provider
    (``ray.cluster_utils.AutoscalingCluster``'s, which cannot be used as it is: it runs
    ``ray stop --force``, and the wheel lacks its base config): the autoscaler starts and
    stops real worker nodes on this machine, in the head's process group.

    The auth mode and token come from the environment (tests/conftest.py sets a token of
    the session's own), so this process's Ray clients and the cluster agree."""
    from ray._private.utils import get_dashboard_dependency_error

    temp_dir = Path(tempfile.mkdtemp(prefix="r", dir=os.environ.get("RAY_TMPDIR")))
    port, dashboard, agent = free_port(), free_port(), free_port()
    # Ray without its dashboard's packages (not ray[default], as bench/gpu_check.py --site
    # installs it) refuses --include-dashboard: such a cluster has no Jobs API
    with_dashboard = get_dashboard_dependency_error() is None
    metrics = free_port()
    log = temp_dir / "ray-start.log"
    autoscaling: list[str] = []
    env = dict(os.environ)
    if node_types is not None:
        config = temp_dir / "autoscaling.json"
        config.write_text(json.dumps(_fake_cluster(num_cpus, node_types, f"127.0.0.1:{port}")))
        autoscaling = [f"--autoscaling-config={config}"]
        env.update(RAY_FAKE_CLUSTER="1", AUTOSCALER_UPDATE_INTERVAL_S="1")
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                *RAY,
                "start",
                "--head",
                "--block",
                "--disable-usage-stats",
                *("--num-cpus", str(num_cpus)),  # GPUs: what Ray detects
                *(("--resources", resources) if resources else ()),
                *("--node-ip-address", "127.0.0.1", "--port", str(port)),
                *("--temp-dir", str(temp_dir)),
                *("--include-dashboard", str(with_dashboard).lower()),
                *("--dashboard-host", "127.0.0.1"),
                *("--dashboard-port", str(dashboard)),
                # every port of its own: a default one held by another Ray on this machine
                # (52365, the agent's) leaves the Jobs API answering "no available agent"
                *("--dashboard-agent-listen-port", str(agent)),
                *("--metrics-export-port", str(metrics)),
                *_node_ports(),
                *autoscaling,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its own process group: stopped by that group alone
        )
    try:
        _wait_listening([port, dashboard, agent] if with_dashboard else [port], proc, log)
        yield RayCluster(
            address=f"127.0.0.1:{port}",
            dashboard=f"http://127.0.0.1:{dashboard}" if with_dashboard else "",
            metrics_port=metrics,
            temp_dir=temp_dir,
            pid=proc.pid,
        )
    finally:
        stop_group(proc.pid)
        proc.wait(10)


def _fake_cluster(head_cpus: int, node_types: dict[str, Any], gcs: str) -> dict[str, Any]:
    """The fake multi-node provider's cluster config (Ray's
    ``autoscaler/_private/fake_multi_node/example.yaml``, which its wheel does not ship):
    workers of ``node_types`` that join the GCS at ``gcs``, idle ones removed after 6 s."""
    return {
        "cluster_name": "fake_multinode",
        "max_workers": 8,
        "provider": {
            "type": "fake_multinode",
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
            "gcs_address": gcs,
        },
        "available_node_types": {
            "ray.head.default": {
                "resources": {"CPU": head_cpus},
                "node_config": {},
                "max_workers": 0,
            },
            **node_types,
        },
        "head_node_type": "ray.head.default",
        "auth": {},
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": 0.1,
        "docker": {},
        **{
            key: []
            for key in (
                "initialization_commands",
                "setup_commands",
                "head_setup_commands",
                "worker_setup_commands",
                "head_start_ray_commands",
                "worker_start_ray_commands",
                "cluster_synced_files",
                "rsync_exclude",
                "rsync_filter",
            )
        },
        "file_mounts": {},
        "file_mounts_sync_continuously": False,
    }


@contextlib.contextmanager
def ray_node(head: RayCluster, num_cpus: int, resources: str = "") -> Iterator[int]:
    """Start another node of ``head``'s cluster on this machine (``ray start --address``),
    in a process group of its own; yields its leader's pid (``stop_group`` kills the node
    as a lost machine would be). Stopped on exit if still there."""
    agent = free_port()
    log = head.temp_dir / f"ray-node-{agent}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                *RAY,
                "start",
                "--address",
                head.address,
                "--block",
                *("--num-cpus", str(num_cpus)),
                *(("--resources", resources) if resources else ()),
                *("--node-ip-address", "127.0.0.1"),
                *("--dashboard-agent-listen-port", str(agent)),
                *("--metrics-export-port", str(free_port())),
                *_node_ports(),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        _wait_listening([agent], proc, log)
        yield proc.pid
    finally:
        stop_group(proc.pid)
