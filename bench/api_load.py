"""API load: 32 concurrent clients creating and listing fine-tuning jobs against a real
server (uvicorn, --workers, default 2), on SQLite and then PostgreSQL.

Three phases per backend. Closed loop: 32 clients each create jobs and list after every
fifth, sending their next request as soon as the last one answers; this gives the most
creations per second the server sustains (latency there is set by Little's law: 32 in
flight / throughput). Open loop: 32 connections offer a fixed 300 creations/s and 60
lists/s on a schedule, and latency is measured from each request's scheduled time (no
coordinated omission); this is the latency at the target rate. Then the same offered
creations without the lists.
Afterwards the database must hold every job exactly once (each create carries a unique
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
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of the server process and its workers so far."""
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return sum(t.user + t.system for t in (p.cpu_times() for p in procs))


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


async def offered_load(
    base: str,
    keys: list[str],
    files: list[str],
    clients: int,
    rate: float,
    duration_s: float,
    *,
    lists: bool,
    tag: str,
) -> dict[str, Any]:
    """Creates offered at ``rate`` per second on a fixed schedule over ``clients``
    connections, with (``lists``) one list of jobs per five creates, the closed loop's mix;
    each latency counts from the request's scheduled start."""
    n = int(rate * duration_s)
    latencies: list[float] = []
    list_latencies: list[float] = []
    errors: list[str] = []
    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(base, connector=connector) as http:
        start = time.perf_counter() + 0.2

        async def create(i: int) -> None:
            due = start + i / rate
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            key, file_id = keys[i % len(keys)], files[i % len(files)]
            body = {
                "model": "tiny-llama",
                "training_file": file_id,
                "metadata": {"client": f"{tag}-{i % clients}", "seq": str(i)},
            }
            headers = {"Authorization": f"Bearer {key}", "Idempotency-Key": f"{tag}-{i}"}
            async with http.post("/v1/fine_tuning/jobs", json=body, headers=headers) as resp:
                await resp.read()
            latencies.append(time.perf_counter() - due)
            if resp.status != 200:
                errors.append(f"create {resp.status}")

        async def list_jobs(j: int) -> None:
            due = start + (5 * j + 2.5) / rate
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            headers = {"Authorization": f"Bearer {keys[j % len(keys)]}"}
            async with http.get("/v1/fine_tuning/jobs?limit=20", headers=headers) as resp:
                await resp.read()
            list_latencies.append(time.perf_counter() - due)
            if resp.status != 200:
                errors.append(f"list {resp.status}")

        n_lists = n // 5 if lists else 0
        await asyncio.gather(
            *[create(i) for i in range(n)], *[list_jobs(j) for j in range(n_lists)]
        )
        wall = time.perf_counter() - start
    return {
        "offered_per_s": rate,
        "offered_lists_per_s": rate / 5 if lists else 0,
        "achieved_per_s": round(n / wall, 1),
        "creates": n,
        "p50_ms": round(1000 * statistics.median(latencies), 1),
        "p99_ms": round(1000 * percentile(latencies, 0.99), 1),
        "list_p50_ms": round(1000 * statistics.median(list_latencies), 1) if lists else None,
        "list_p99_ms": round(1000 * percentile(list_latencies, 0.99), 1) if lists else None,
        "errors": errors[:5],
    }


def run_backend(
    kind: str,
    db_url: str,
    clients: int,
    per_client: int,
    rate: float,
    duration_s: float,
    workers: int,
) -> dict[str, Any]:
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
            str(workers),
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
            worker = psutil.Process(server.pid).children()[-1].pid
            subprocess.Popen(
                [
                    str(Path(sys.executable).parent / "py-spy"),
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
        cpu0 = server_cpu_s(server.pid)
        wall = asyncio.run(main())
        # The API's own CPU per request in the closed loop: steadier than throughput on a
        # shared machine, and what the server's capacity is divided by.
        api_cpu_ms = 1000 * (server_cpu_s(server.pid) - cpu0) / (len(creates) + len(lists))
        open_loop = asyncio.run(
            offered_load(base, keys, files, clients, rate, duration_s, lists=True, tag="open")
        )
        creates_only = asyncio.run(
            offered_load(base, keys, files, clients, rate, duration_s, lists=False, tag="only")
        )
        # Count what reached the database (the source of truth), not what the API says.
        from sqlalchemy import select

        from tunefleet.platform.db import Job

        seen: dict[tuple[str, str], int] = {}
        with session_scope(db_url) as s:
            jobs = list(s.scalars(select(Job.metadata_)))
        for meta in jobs:
            k = (meta["client"], meta["seq"])
            seen[k] = seen.get(k, 0) + 1
        expected = clients * per_client + open_loop["creates"] + creates_only["creates"]
        return {
            "backend": kind,
            "api_workers": workers,
            "closed_loop": {
                "clients": clients,
                "creates": len(creates),
                "wall_s": round(wall, 3),
                "creates_per_s": round(len(creates) / wall, 1),
                "create_p50_ms": round(1000 * statistics.median(creates), 1),
                "create_p99_ms": round(1000 * percentile(creates, 0.99), 1),
                "list_p50_ms": round(1000 * statistics.median(lists), 1),
                "list_p99_ms": round(1000 * percentile(lists, 0.99), 1),
                "api_cpu_ms_per_request": round(api_cpu_ms, 3),
                "errors": errors[:5],
            },
            "open_loop": open_loop,
            "open_loop_creates_only": creates_only,
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
    parser.add_argument("--workers", type=int, default=2, help="uvicorn worker processes")
    parser.add_argument("--rate", type=float, default=300.0, help="open-loop creates/s")
    parser.add_argument("--duration", type=float, default=5.0, help="open-loop seconds")
    args = parser.parse_args()
    shape = (args.clients, args.creates_per_client, args.rate, args.duration, args.workers)
    from pg import postgres_cluster

    results = []
    sqlite_url = f"sqlite:///{tempfile.mkdtemp(prefix='apiload-')}/load.db"
    results.append(run_backend("sqlite", sqlite_url, *shape))
    with postgres_cluster() as pg_url:
        results.append(run_backend("postgresql", pg_url, *shape))
    pg = results[-1]
    out = {
        "benchmark": "api_load",
        "machine": f"{os.cpu_count()} CPUs",
        "results": results,
        "target": {"creates_per_s": 300, "create_p99_ms": 100, "backend": "postgresql"},
        # Read with the lists the clients also make: 300 creates/s sustained (closed loop)
        # and p99 < 100 ms when 300 creates/s (+ 60 lists/s) are offered (open loop).
        "target_met": pg["closed_loop"]["creates_per_s"] >= 300 and pg["open_loop"]["p99_ms"] < 100,
        "creates_only_target_met": pg["open_loop_creates_only"]["achieved_per_s"] >= 297
        and pg["open_loop_creates_only"]["p99_ms"] < 100,
        "integrity_ok": all(
            r["lost"] == 0
            and r["duplicated"] == 0
            and not r["closed_loop"]["errors"]
            and not r["open_loop"]["errors"]
            and not r["open_loop_creates_only"]["errors"]
            for r in results
        ),
    }
    dest = ROOT / "bench" / "results" / "api_load.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
