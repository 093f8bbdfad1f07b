"""The repository layout: nothing at the root shadows the standard library, and the
dependency rules (import-linter contracts in pyproject.toml) hold."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
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


def _imports(path: Path) -> Iterator[str]:
    """The ``tunefleet`` modules a file imports (a name imported from a package counts as
    that package's module of the name, when there is one)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("tunefleet"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tunefleet"):
            yield node.module or ""
            yield from (f"{node.module}.{a.name}" for a in node.names)


def test_private_modules_are_used_only_by_their_own_package() -> None:
    """STYLE rule 2: a module whose name starts with ``_`` is its package's own. Only
    modules of that package (and its subpackages) import it; tests and benchmarks may, to
    test and measure it."""
    found = []
    sources = [
        *(p for root in ("platform", "workers", "api") for p in (ROOT / root).rglob("*.py")),
        *(ROOT / "migrations").rglob("*.py"),
    ]
    for path in sources:
        parts = path.relative_to(ROOT).with_suffix("").parts
        importer = ".".join(parts[1:]) if parts[0] in ("platform", "workers", "api") else ""
        for module in _imports(path):
            names = module.split(".")
            private = next((i for i, n in enumerate(names) if n.startswith("_")), None)
            if private is None:
                continue
            package = ".".join(names[:private])
            if not importer.startswith(package + "."):
                found.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not found, "\n".join(found)


def test_every_package_says_what_it_offers() -> None:
    """Each package's ``__init__`` has a docstring, and re-exports (``__all__``) the names
    other packages use from it, or says which of its modules are its surface."""
    for root in ("platform", "workers", "api"):
        for init in (ROOT / root).rglob("__init__.py"):
            doc = ast.get_docstring(ast.parse(init.read_text()))
            assert doc, f"{init.relative_to(ROOT)} has no docstring"
