"""A baseline revision of this repository, to run a benchmark's code beside the checkout's
in the same run (the machine is shared and noisy: only same-run comparisons count)."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What a benchmark needs of a revision: its Python roots, its migrations, and its own
# benchmark scripts and test helpers (a revision's scripts import that revision's names).
TREE = ("api", "platform", "workers", "migrations", "bench", "tests")


def baseline_tree(rev: str) -> Path:
    """``rev`` of this repository (the parts in ``TREE`` it has), in a temporary folder."""
    dest = Path(tempfile.mkdtemp(prefix="tunefleet-baseline-"))
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-tree", "--name-only", rev],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, *(p for p in TREE if p in listed)],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def code_env(code: Path | None) -> dict[str, str]:
    """The environment that runs ``code`` (a tree holding api/, platform/ and workers/)
    instead of the installed checkout: its roots come first on the path (Ray's local
    cluster, started from this environment, hands the path to its workers)."""
    env = dict(os.environ)
    if code is not None:
        env["PYTHONPATH"] = os.pathsep.join(str(code / r) for r in ("api", "platform", "workers"))
    return env
