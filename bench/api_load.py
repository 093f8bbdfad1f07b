"""API load: 32 concurrent clients creating and listing fine-tuning jobs against a real
server (uvicorn, 2 workers), on SQLite and then PostgreSQL.

Reports creations per second and p50/p99 latency of creates and of lists, then checks
in the database that every job arrived exactly once (each create carries a unique
Idempotency-Key and metadata naming its client and sequence number).
Target on the 2-core reference machine: >= 300 creations/s on PostgreSQL, p99 < 100 ms.

    .venv/bin/python bench/api_load.py [--clients 32] [--creates-per-client 50]
Writes bench/results/api_load.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def client_loop(
    http: aiohttp.ClientSession,
    key: str,
    file_id: str,
    client: int,
    n: int,
    creates: list[float],
    lists: list[float],
    errors: list[str],
) -> None:
    headers = {"Authorization": f"Bearer {key}"}
    for seq in range(n):
        t0 = time.perf_counter()
        async with http.post(
            "/v1/fine_tuning/jobs",
            headers={**headers, "Idempotency-Key": f"c{client}-s{seq}"},
            json={
                "model": "tiny-llama",
                "training_file": file_id,
                "seed": seq,
                "metadata": {"client": str(client), "seq": str(seq)},
            },
        ) as resp:
            body = await resp.read()
        creates.append(time.perf_counter() - t0)
        if resp.status != 200:
            errors.append(f"create {resp.status}: {body[:200]!r}")
        if seq % 5 == 4:
            t0 = time.perf_counter()
            async with http.get(
                "/v1/fine_tuning/jobs", headers=headers, params={"limit": "20"}
            ) as resp:
                await resp.read()
            lists.append(time.perf_counter() - t0)
            if resp.status != 200:
                errors.append(f"list {resp.status}")


def run_backend(kind: str, db_url: str, clients: int, per_client: int) -> dict[str, Any]:
    from tinyllm import build_tiny_llama
    from tunefleet.platform.db import session_scope
    from tunefleet.platform.db.migrate import upgrade
    from tunefleet.platform.tenants import create_key, create_tenant

    data = Path(tempfile.mkdtemp(prefix=f"apiload-{kind}-"))
    build_tiny_llama(data / "models" / "tiny-llama")
    upgrade(db_url)
    with session_scope(db_url) as s:
        tenants = [create_tenant(s, f"load-{i}") for i in range(4)]
        keys = [create_key(s, t.id)[1] for t in tenants]
    port = free_port()
    env = {**os.environ, "TUNEFLEET_DATA_DIR": str(data), "TUNEFLEET_DATABASE_URL": db_url}
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "--factory",
            "tunefleet.api.app:create_app",
            "--port",
            str(port),
            "--workers",
            "2",
            "--log-level",
            "warning",
            "--no-access-log",
        ],
        env=env,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                if httpx.get(base + "/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        files = []
        for key in keys:
            resp = httpx.post(
                base + "/v1/files",
                headers={"Authorization": f"Bearer {key}"},
                data={"purpose": "fine-tune"},
                files={"file": ("t.jsonl", json.dumps(CHAT).encode())},
            )
            files.append(resp.json()["id"])
        creates: list[float] = []
        lists: list[float] = []
        errors: list[str] = []

        async def main() -> float:
            # aiohttp, not httpx: the load generator shares the 2 cores with the server
            # and must cost as little CPU per request as it can.
            connector = aiohttp.TCPConnector(limit=clients)
            async with aiohttp.ClientSession(base, connector=connector) as http:
                t0 = time.perf_counter()
                await asyncio.gather(
                    *[
                        client_loop(
                            http, keys[c % 4], files[c % 4], c, per_client, creates, lists, errors
                        )
                        for c in range(clients)
                    ]
                )
                return time.perf_counter() - t0

        if os.environ.get("APILOAD_PYSPY"):  # profile one API worker while under load
            import psutil

            worker = psutil.Process(server.pid).children()[-1].pid
            subprocess.Popen(
                [
                    "py-spy",
                    "record",
                    "-d",
                    "8",
                    "-f",
                    "raw",
                    "-o",
                    os.environ["APILOAD_PYSPY"] + f".{kind}",
                    "-p",
                    str(worker),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        wall = asyncio.run(main())
        # Count what reached the database (the source of truth), not what the API says.
        from sqlalchemy import select

        from tunefleet.platform.db import Job

        seen: dict[tuple[str, str], int] = {}
        with session_scope(db_url) as s:
            jobs = list(s.scalars(select(Job.metadata_)))
        for meta in jobs:
            k = (meta["client"], meta["seq"])
            seen[k] = seen.get(k, 0) + 1
        expected = clients * per_client
        return {
            "backend": kind,
            "clients": clients,
            "creates": len(creates),
            "wall_s": round(wall, 3),
            "creates_per_s": round(len(creates) / wall, 1),
            "create_p50_ms": round(1000 * statistics.median(creates), 1),
            "create_p99_ms": round(1000 * percentile(creates, 0.99), 1),
            "list_p50_ms": round(1000 * statistics.median(lists), 1),
            "list_p99_ms": round(1000 * percentile(lists, 0.99), 1),
            "errors": errors[:5],
            "jobs_stored": len(jobs),
            "lost": expected - len(seen),
            "duplicated": sum(v - 1 for v in seen.values()),
        }
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--creates-per-client", type=int, default=50)
    args = parser.parse_args()
    from pg import postgres_cluster

    results = []
    sqlite_url = f"sqlite:///{tempfile.mkdtemp(prefix='apiload-')}/load.db"
    results.append(run_backend("sqlite", sqlite_url, args.clients, args.creates_per_client))
    with postgres_cluster() as pg_url:
        results.append(run_backend("postgresql", pg_url, args.clients, args.creates_per_client))
    pg = results[-1]
    out = {
        "benchmark": "api_load",
        "machine": f"{os.cpu_count()} CPUs",
        "results": results,
        "target": {"creates_per_s": 300, "create_p99_ms": 100, "backend": "postgresql"},
        "target_met": pg["creates_per_s"] >= 300 and pg["create_p99_ms"] < 100,
        "integrity_ok": all(
            r["lost"] == 0 and r["duplicated"] == 0 and not r["errors"] for r in results
        ),
    }
    dest = ROOT / "bench" / "results" / "api_load.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
