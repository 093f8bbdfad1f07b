"""The Ray cluster's nodes, as the dashboard's overview shows them, read over HTTP from
Ray's dashboard (``GET /nodes?view=summary``): the API never imports Ray.

A cluster that does not answer (or answers what this does not understand) is a state of
the page, ``ClusterView.error``, never an exception.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

TIMEOUT_S = 1.5
_USAGE = re.compile(r"^\s*([0-9.]+)/([0-9.]+)\s+(CPU|GPU)\b")


@dataclass(frozen=True)
class NodeView:
    id: str
    host: str
    alive: bool
    head: bool
    cpus: float
    cpus_used: float | None
    gpus: float
    gpus_used: float | None
    memory: int | None  # the machine's RAM, bytes
    memory_used: int | None
    ip: str = ""
    metrics_port: int | None = None  # where Ray's metrics agent exports (Prometheus)


@dataclass(frozen=True)
class ClusterView:
    url: str
    nodes: list[NodeView] = field(default_factory=list)
    error: str | None = None

    @property
    def totals(self) -> dict[str, float]:
        alive = [n for n in self.nodes if n.alive]
        return {
            "cpus": sum(n.cpus for n in alive),
            "cpus_used": sum(n.cpus_used or 0 for n in alive),
            "gpus": sum(n.gpus for n in alive),
            "gpus_used": sum(n.gpus_used or 0 for n in alive),
        }


def ray_token() -> str | None:
    """Ray's token (Ray 2.60 authenticates its dashboard), where Ray's own clients look:
    ``RAY_AUTH_TOKEN``, the file ``RAY_AUTH_TOKEN_PATH``, ``~/.ray/auth_token``."""
    if token := os.environ.get("RAY_AUTH_TOKEN", "").strip():
        return token
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def _usage(text: Any) -> dict[str, tuple[float, float]]:
    """``{"CPU": (used, total), ...}`` from Ray's per-node usage lines ("1.0/4.0 CPU")."""
    out: dict[str, tuple[float, float]] = {}
    for line in str(text or "").splitlines():
        if m := _USAGE.match(line):
            out[m.group(3)] = (float(m.group(1)), float(m.group(2)))
    return out


def parse_nodes(payload: dict[str, Any]) -> list[NodeView]:
    """The nodes of a ``/nodes?view=summary`` answer (``data.summary``, one entry per node,
    with ``data.nodeLogicalResources`` holding each node's usage lines)."""
    data = payload.get("data") or {}
    logical = data.get("nodeLogicalResources") or {}
    nodes = []
    for entry in data.get("summary") or []:
        raylet = entry.get("raylet") or {}
        node_id = str(raylet.get("nodeId") or "")
        totals = raylet.get("resourcesTotal") or {}
        # keyed by node id (older Rays: by the node's address)
        usage = _usage(logical.get(node_id) or logical.get(str(entry.get("ip"))))
        mem = entry.get("mem") or []  # [total, available, percent, used]
        nodes.append(
            NodeView(
                id=node_id,
                host=str(entry.get("hostname") or raylet.get("nodeManagerHostname") or "?"),
                alive=raylet.get("state", "ALIVE") == "ALIVE",
                head=bool(raylet.get("isHeadNode")),
                cpus=float(totals.get("CPU", usage.get("CPU", (0, 0))[1])),
                cpus_used=usage["CPU"][0] if "CPU" in usage else None,
                gpus=float(totals.get("GPU", usage.get("GPU", (0, 0))[1])),
                gpus_used=usage["GPU"][0] if "GPU" in usage else None,
                memory=int(mem[0]) if len(mem) >= 1 else None,
                memory_used=int(mem[3]) if len(mem) >= 4 else None,
                ip=str(entry.get("ip") or raylet.get("nodeManagerAddress") or ""),
                metrics_port=int(raylet["metricsExportPort"])
                if raylet.get("metricsExportPort")
                else None,
            )
        )
    return sorted(nodes, key=lambda n: (not n.head, n.host, n.id))


def fetch_cluster(url: str, *, timeout: float = TIMEOUT_S) -> ClusterView:
    """The nodes Ray's dashboard at ``url`` reports, or a view naming why there are none."""
    headers = {"Authorization": f"Bearer {token}"} if (token := ray_token()) else {}
    try:
        resp = httpx.get(
            f"{url}/nodes", params={"view": "summary"}, headers=headers, timeout=timeout
        )
    except httpx.HTTPError as exc:
        return ClusterView(url, error=f"Ray unreachable at {url} ({type(exc).__name__})")
    if resp.status_code in (401, 403):
        return ClusterView(
            url,
            error=f"Ray at {url} refused the API's token (HTTP {resp.status_code}); give the "
            "API process Ray's token in RAY_AUTH_TOKEN",
        )
    try:
        resp.raise_for_status()
        return ClusterView(url, nodes=parse_nodes(resp.json()))
    except (httpx.HTTPError, ValueError, TypeError, AttributeError) as exc:
        return ClusterView(
            url, error=f"Ray at {url} answered what the dashboard cannot read ({exc})"[:300]
        )
