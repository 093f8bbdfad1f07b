"""The repository layout: nothing at the root shadows the standard library, and the
dependency rules (import-linter contracts in pyproject.toml) hold."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_platform_folder_does_not_shadow_the_stdlib() -> None:
    out = subprocess.run(
        [sys.executable, "-c", "import uuid, platform; print(platform.system())"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "Linux"
    # and with the repo root first on sys.path, as `python -m`, pytest and Ray do
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.path.insert(0, '.'); import uuid, platform; print(platform.system())",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "Linux"


def test_nothing_importable_at_the_root() -> None:
    assert not list(ROOT.glob("*.py"))
    assert not [p for p in ROOT.iterdir() if (p / "__init__.py").exists()]
    for root in ("platform", "workers", "api"):
        assert not (ROOT / root / "tunefleet" / "__init__.py").exists(), "namespace, not package"


def test_import_contracts_hold() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    for contract in (
        "platform is the core",
        "api and workers meet only through platform",
        "api never imports Ray or torch",
    ):
        assert f"{contract}" in out.stdout and "KEPT" in out.stdout
