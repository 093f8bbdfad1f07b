"""The Helm chart as the tests see it: rendered by the real Helm (`make helm` puts it in
.venv/bin/helm), offline, for Kubernetes 1.32 with KubeRay's API present."""

from __future__ import annotations

import subprocess
import sys
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
) -> list[dict[str, Any]]:
    """`helm template` of the chart: its objects, hooks included."""
    args = ["template", release, str(CHART), "--namespace", namespace]
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
