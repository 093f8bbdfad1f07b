"""The Helm chart as the tests see it: rendered by the real Helm (`make helm` puts it in
.venv/bin/helm), offline, for Kubernetes 1.32 with KubeRay's API present; and, for the
chart's `lookup`s, a stand-in API server on localhost that holds a few core objects."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "tunefleet"
HELM = Path(sys.executable).parent / "helm"
KUBE_VERSION = "1.32"
# what a cluster with KubeRay (and, for the ServiceMonitor, the Prometheus Operator) has
API_VERSIONS = ("ray.io/v1/RayCluster", "monitoring.coreos.com/v1/ServiceMonitor")


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    if not HELM.exists():
        raise RuntimeError(f"no Helm at {HELM}: run `make helm` (the test targets do)")
    return subprocess.run([str(HELM), *args], capture_output=True, text=True, check=check)


def render(
    values: Path | None = None,
    *sets: str,
    api_versions: tuple[str, ...] = API_VERSIONS,
    release: str = "tf",
    namespace: str = "tunefleet",
    kubeconfig: Path | None = None,
) -> list[dict[str, Any]]:
    """`helm template` of the chart: its objects, hooks included. With ``kubeconfig`` (see
    `cluster_holding`), the chart's `lookup`s ask that cluster, as at `helm install`."""
    args = ["template", release, str(CHART), "--namespace", namespace]
    if kubeconfig is not None:
        args += ["--dry-run=server", "--kubeconfig", str(kubeconfig)]
    args += ["--kube-version", KUBE_VERSION]
    for version in api_versions:
        args += ["--api-versions", version]
    if values is not None:
        args += ["-f", str(values)]
    for item in sets:
        args += ["--set", item]
    out = helm(*args)
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def find(objects: list[dict[str, Any]], kind: str, suffix: str) -> dict[str, Any]:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"].endswith(suffix)]
    return found


def pod_specs(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """The pod templates' specs of a workload (a RayCluster's head and every group)."""
    spec = obj.get("spec", {})
    if obj["kind"] in ("Deployment", "StatefulSet", "Job"):
        return [spec["template"]["spec"]]
    if obj["kind"] == "RayCluster":
        groups = [spec["headGroupSpec"], *spec.get("workerGroupSpecs", [])]
        return [g["template"]["spec"] for g in groups]
    return []


def container(obj: dict[str, Any], name: str) -> dict[str, Any]:
    (spec,) = pod_specs(obj)
    (found,) = [c for c in spec["containers"] if c["name"] == name]
    return found


@contextmanager
def cluster_holding(*objects: dict[str, Any]) -> Iterator[Path]:
    """A stand-in Kubernetes API server on localhost that holds ``objects`` (core v1, such
    as Secrets) and answers what Helm's `lookup` asks: the v1 resource list and GETs of
    one object. Yields a kubeconfig for it."""
    kinds = {o["kind"] for o in objects}
    resources = [
        {"name": f"{kind.lower()}s", "namespaced": True, "kind": kind, "verbs": ["get"]}
        for kind in sorted(kinds)
    ]
    paths = {
        f"/api/v1/namespaces/{o['metadata']['namespace']}/{o['kind'].lower()}s/"
        f"{o['metadata']['name']}": o
        for o in objects
    }

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            status, body = 200, paths.get(path)
            if path == "/api/v1":
                body = {"kind": "APIResourceList", "groupVersion": "v1", "resources": resources}
            elif body is None:  # what lookup turns into an empty result
                status, body = 404, {"kind": "Status", "apiVersion": "v1", "code": 404}
                body |= {"status": "Failure", "reason": "NotFound"}
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    server_url = f"http://127.0.0.1:{server.server_address[1]}"
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "stand-in", "cluster": {"server": server_url}}],
        "users": [{"name": "stand-in", "user": {}}],
        "contexts": [{"name": "stand-in", "context": {"cluster": "stand-in", "user": "stand-in"}}],
        "current-context": "stand-in",
    }
    try:
        with tempfile.TemporaryDirectory() as folder:
            kubeconfig = Path(folder) / "kubeconfig"
            kubeconfig.write_text(yaml.safe_dump(config))
            yield kubeconfig
    finally:
        server.shutdown()
        server.server_close()
