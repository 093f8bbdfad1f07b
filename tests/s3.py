"""A real S3-protocol server on 127.0.0.1 (moto's server mode, in a process of its own) and
buckets on it, for the object-storage artifact store."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from raycluster import free_port, stop_process

MOTO = str(Path(sys.executable).parent / "moto_server")


@contextlib.contextmanager
def s3_server() -> Iterator[str]:
    """Start ``moto_server`` on a free port; yield its endpoint URL; stop it."""
    port = free_port()
    proc = subprocess.Popen(
        [MOTO, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert proc.poll() is None, f"moto_server exited {proc.returncode}"
            assert time.monotonic() < deadline, "moto_server did not listen within 60 s"
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process(proc, grace_s=5)


def new_bucket(endpoint: str) -> str:
    """A fresh bucket; its s3:// URL with a prefix, as TUNEFLEET_ARTIFACT_ROOT takes it."""
    from pyarrow import fs

    bucket = f"tf-{uuid.uuid4().hex[:12]}"
    host = endpoint.removeprefix("http://")
    fs.S3FileSystem(
        endpoint_override=host, scheme="http", region="us-east-1", allow_bucket_creation=True
    ).create_dir(bucket)
    return f"s3://{bucket}/tunefleet"
