"""Before and after: one benchmark run on a baseline revision and on the checkout,
alternating, in one run, with the ratio of each figure.

For a change that must not cost speed (a reshaping, a refactor): the same script, the same
arguments, the same machine minutes apart. Each side runs its own revision's script (a
revision's script imports that revision's names) in a subprocess whose path puts that
revision's code first; the checkout's run writes its usual ``bench/results/<script>.json``.

    .venv/bin/python bench/before_after.py --baseline REV serve_multilora.py -- --repeats 1
    .venv/bin/python bench/before_after.py --baseline REV train_throughput.py [--rounds 2]

Writes ``bench/results/before_after_<script>.json``: each side's figures per round, and per
figure the ratio of the medians, after over before (for times and memory lower is better,
for rates higher).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import machine
from baseline import ROOT, baseline_tree, code_env

# The figures each benchmark is judged by (dotted paths into its results); others: every
# number both sides report.
FIGURES = {
    "serve_multilora": [
        "tokens_per_s.tunefleet.1",
        "tokens_per_s.tunefleet.8",
        "tokens_per_s.tunefleet.32",
        "tokens_per_s.tunefleet.128",
        "tokens_per_s.merged",
        "figures.vs_mixed_batch_at_32",
        "figures.cold_load_median_ms",
    ],
    "train_throughput": [
        "tunefleet.tokens_per_s",
        "baseline_trainer.tokens_per_s",
        "ratio_vs_baseline",
        "tunefleet.mfu_vs_fp32_gemm_peak",
        "tunefleet.peak_memory_bytes",
    ],
}


def numbers(value: Any, prefix: str = "") -> dict[str, float]:
    """Every number in a JSON value, by dotted path."""
    if isinstance(value, bool):
        return {}
    if isinstance(value, int | float):
        return {prefix: float(value)}
    items: list[tuple[str, Any]] = []
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, list):
        items = [(str(i), v) for i, v in enumerate(value)]
    out: dict[str, float] = {}
    for key, item in items:
        out.update(numbers(item, f"{prefix}.{key}" if prefix else key))
    return out


def run_side(tree: Path | None, script: str, args: list[str]) -> tuple[dict[str, Any], float]:
    """Run ``script`` of ``tree`` (None: the checkout); the results it wrote (the newest
    JSON file in its ``bench/results``: a script's options may change the file's name) and
    its wall time."""
    root = tree or ROOT
    started = time.time()
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, str(root / "bench" / script), *args],
        cwd=ROOT,
        env=code_env(tree),
        check=True,
    )
    wall = time.perf_counter() - start
    written = [
        p
        for p in (root / "bench" / "results").glob("*.json")
        if p.stat().st_mtime >= started and not p.name.startswith("before_after_")
    ]
    if not written:
        raise SystemExit(f"{root / 'bench' / script} wrote no results in bench/results")
    newest = max(written, key=lambda p: p.stat().st_mtime)
    return json.loads(newest.read_text()), wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="the revision to compare against")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each side, alternating")
    parser.add_argument("script", help="a script in bench/, e.g. serve_multilora.py")
    parser.add_argument("args", nargs="*", help="the script's arguments (after --)")
    args = parser.parse_args()
    rev = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", args.baseline],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    tree = baseline_tree(rev)
    sides: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    walls: dict[str, list[float]] = {"before": [], "after": []}
    for _ in range(args.rounds):
        for side, code in (("before", tree), ("after", None)):
            result, wall = run_side(code, args.script, args.args)
            sides[side].append(numbers(result))
            walls[side].append(round(wall, 1))
    stem = Path(args.script).stem
    shared = set(sides["before"][0]) & set(sides["after"][0])
    wanted = [f for f in FIGURES.get(stem, sorted(shared)) if f in shared]
    figures = {}
    for name in wanted:
        before = statistics.median(r[name] for r in sides["before"])
        after = statistics.median(r[name] for r in sides["after"])
        figures[name] = {
            "before": [r[name] for r in sides["before"]],
            "after": [r[name] for r in sides["after"]],
            "after_over_before": round(after / before, 4) if before else None,
        }
    out = {
        "benchmark": stem,
        "machine": machine.describe(),
        "baseline": rev,
        "after": subprocess.run(
            ["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
        ).stdout.strip(),
        "arguments": args.args,
        "rounds": args.rounds,
        "wall_s": walls,
        "figures": figures,
    }
    path = ROOT / "bench" / "results" / f"before_after_{stem}.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
