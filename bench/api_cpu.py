"""The API's CPU per request, in one process: revisions side by side, for a change to the
API's code that must not cost.

``api_load.py`` measures the server under 32 clients over TCP. Its CPU per request moves
by about 5% from one run to the next on the 2-core machine, where the load generator, two
uvicorn workers and the database share the cores. This measures the API's own code with
nothing else in the way: one process serves the app (``create_app``) through httpx's ASGI
transport, creates jobs for 16 tenants with the load test's mix (a list of 20 after every
fifth create, an Idempotency-Key and metadata on each) and counts its own CPU time
(user + system) per request, after a warm-up.

Each revision runs in a subprocess that puts its code first on the path
(``bench/baseline.py``), on SQLite and on PostgreSQL (durable: fsync and synchronous
commit on), the revisions alternating in each round so that the machine's drift hits all.
``HEAD`` is the checkout as it is. A pair ``A:B`` reports B's median over A's.

    .venv/bin/python bench/api_cpu.py --revs f53f5fb 4ac796f f8403b1 43906d3 HEAD \\
        --pairs f53f5fb:4ac796f f8403b1:43906d3 [--rounds 3] [--creates 1500]

Writes bench/results/api_cpu.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import machine
from baseline import ROOT, baseline_tree, code_env

OUT = ROOT / "bench" / "results" / "api_cpu.json"
CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
TENANTS = 16
WARM_UP = 50


def child(db_url: str, creates: int) -> dict[str, float]:
    """Serve the app of whatever code is first on the path; CPU ms per request."""
    import httpx

    sys.path.insert(0, str(ROOT / "tests"))
    from tinyllm import build_tiny_llama

    data = Path(tempfile.mkdtemp(prefix="api-cpu-"))
    build_tiny_llama(data / "models" / "tiny-llama")
    os.environ.update(TUNEFLEET_DATA_DIR=str(data), TUNEFLEET_DATABASE_URL=db_url)
    from tunefleet.api.app import create_app
    from tunefleet.platform.db import session_scope
    from tunefleet.platform.db.migrate import upgrade
    from tunefleet.platform.tenants import create_key, create_tenant

    upgrade(db_url)
    with session_scope(db_url) as s:
        keys = [create_key(s, create_tenant(s, f"t{i}").id)[1] for i in range(TENANTS)]
    app = create_app()

    async def run() -> dict[str, float]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as http:
            files = []
            for key in keys:
                resp = await http.post(
                    "/v1/files",
                    headers={"Authorization": f"Bearer {key}"},
                    data={"purpose": "fine-tune"},
                    files={"file": ("t.jsonl", json.dumps(CHAT).encode())},
                )
                files.append(resp.json()["id"])

            async def one(i: int) -> int:
                auth = {"Authorization": f"Bearer {keys[i % TENANTS]}"}
                resp = await http.post(
                    "/v1/fine_tuning/jobs",
                    headers={**auth, "Idempotency-Key": f"k{i}"},
                    json={
                        "model": "tiny-llama",
                        "training_file": files[i % TENANTS],
                        "seed": i,
                        "metadata": {"i": str(i)},
                    },
                )
                if resp.status_code != 200:
                    raise RuntimeError(f"create {resp.status_code}: {resp.text[:300]}")
                if i % 5 != 4:
                    return 1
                resp = await http.get("/v1/fine_tuning/jobs", headers=auth, params={"limit": 20})
                if resp.status_code != 200:
                    raise RuntimeError(f"list {resp.status_code}: {resp.text[:300]}")
                return 2

            for i in range(WARM_UP):
                await one(creates + i)
            cpu0, wall0 = time.process_time(), time.perf_counter()
            requests = 0
            for i in range(creates):
                requests += await one(i)
            cpu = time.process_time() - cpu0
            return {
                "cpu_ms_per_request": round(1000 * cpu / requests, 4),
                "wall_ms_per_request": round(1000 * (time.perf_counter() - wall0) / requests, 4),
                "requests": requests,
            }

    return asyncio.run(run())


def median_ratio(after: list[float], before: list[float]) -> float:
    return round(statistics.median(after) / statistics.median(before), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--revs", nargs="+", default=["HEAD"], help="revisions; HEAD: checkout")
    parser.add_argument("--pairs", nargs="*", default=[], help="BEFORE:AFTER to compare")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--creates", type=int, default=1500)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.creates)))
        return

    sys.path.insert(0, str(ROOT / "tests"))
    from sqlalchemy import create_engine, text

    from pg import postgres_cluster

    for pair in args.pairs:
        if pair.count(":") != 1 or not set(pair.split(":")) <= set(args.revs):
            parser.error(f"--pairs {pair!r}: give BEFORE:AFTER, both among --revs")
    trees = {rev: None if rev == "HEAD" else baseline_tree(rev) for rev in args.revs}
    figures: dict[str, dict[str, list[float]]] = {"sqlite": {}, "postgresql": {}}
    with postgres_cluster(durable=True) as pg_url:
        admin = create_engine(pg_url, isolation_level="AUTOCOMMIT")
        for i in range(args.rounds):
            for n, (rev, tree) in enumerate(trees.items()):
                name = f"cpu_{i}_{n}"
                with admin.connect() as conn:
                    conn.execute(text(f"CREATE DATABASE {name}"))
                urls = {
                    "sqlite": f"sqlite:///{tempfile.mkdtemp(prefix='api-cpu-')}/api.db",
                    "postgresql": pg_url.rsplit("/", 1)[0] + "/" + name,
                }
                for backend, url in urls.items():
                    cmd = [sys.executable, __file__, "--child", url, "--creates", str(args.creates)]
                    done = subprocess.run(cmd, env=code_env(tree), capture_output=True, text=True)
                    if done.returncode:
                        raise SystemExit(f"{rev} on {backend} failed:\n{done.stderr[-3000:]}")
                    got = json.loads(done.stdout.strip().splitlines()[-1])
                    figures[backend].setdefault(rev, []).append(got["cpu_ms_per_request"])
                    print(f"round {i} {backend:10s} {rev:8s} {got}", flush=True)
        admin.dispose()
    out = {
        "benchmark": "api_cpu",
        "machine": machine.describe(),
        "postgresql": "durable (fsync and synchronous_commit on, the defaults)",
        "rounds": args.rounds,
        "creates_per_run": args.creates,
        "cpu_ms_per_request": figures,
        "median_cpu_ms_per_request": {
            backend: {rev: round(statistics.median(v), 4) for rev, v in runs.items()}
            for backend, runs in figures.items()
        },
        "ratios_after_over_before": {
            pair: {
                backend: median_ratio(runs[pair.split(":")[1]], runs[pair.split(":")[0]])
                for backend, runs in figures.items()
            }
            for pair in args.pairs
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out["ratios_after_over_before"], indent=1))


if __name__ == "__main__":
    main()
