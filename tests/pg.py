"""A throwaway PostgreSQL cluster from the machine's binaries, for the test session.

PostgreSQL refuses to run as root, so as root the cluster runs as the ``postgres`` user
in a folder it owns. ``initdb`` + ``pg_ctl start`` take about half a second.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from raycluster import free_port


def pg_bin() -> Path | None:
    if found := shutil.which("pg_ctl"):
        return Path(found).parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    return Path(versions[-1]).parent if versions else None


class PgServer:
    """A running cluster that can be stopped and started again on the same port and data,
    as an outage of the database server would (``stop`` cuts every connection)."""

    def __init__(self, bindir: Path, base: Path, port: int, opts: str, run_as: list[str]):
        self.bindir, self.base, self.port, self.opts, self.run_as = bindir, base, port, opts, run_as
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"

    def _ctl(self, *args: str) -> None:
        subprocess.run(
            [*self.run_as, str(self.bindir / "pg_ctl"), "-D", str(self.base / "data"), *args],
            check=True,
            capture_output=True,
        )

    def start(self) -> None:
        self._ctl("-o", self.opts, "-l", str(self.base / "log"), "-w", "start")

    def stop(self) -> None:
        self._ctl("-m", "immediate", "-w", "stop")


@contextmanager
def postgres_server(*, durable: bool = False) -> Iterator[PgServer]:
    """A fresh cluster, started; stopped and removed afterwards.

    The tests' cluster skips ``fsync`` (a commit costs no disk flush); ``durable`` keeps
    PostgreSQL's production defaults (``fsync`` and ``synchronous_commit`` on), for
    benchmarks whose figures must hold in a real deployment."""
    bindir = pg_bin()
    if bindir is None:
        raise RuntimeError("PostgreSQL binaries not found (install postgresql-15)")
    as_root = os.geteuid() == 0
    base = Path(tempfile.mkdtemp(prefix="tunefleet-pg-"))
    run_as: list[str] = ["runuser", "-u", "postgres", "--"] if as_root else []
    if as_root:
        shutil.chown(base, "postgres")
        os.chmod(base, 0o700)
    port = free_port()
    subprocess.run(
        [
            *run_as,
            str(bindir / "initdb"),
            "-D",
            str(base / "data"),
            "-A",
            "trust",
            "-U",
            "postgres",
            *([] if durable else ["--no-sync"]),
        ],
        check=True,
        capture_output=True,
    )
    opts = f"-p {port} -k {base} -c listen_addresses=127.0.0.1 -c max_connections=200"
    if not durable:
        opts += " -c fsync=off"
    server = PgServer(bindir, base, port, opts, run_as)
    server.start()
    try:
        yield server
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            server.stop()
        shutil.rmtree(base, ignore_errors=True)


@contextmanager
def postgres_cluster(*, durable: bool = False) -> Iterator[str]:
    """Yields a SQLAlchemy URL of a fresh cluster's ``postgres`` database (see
    ``postgres_server``)."""
    with postgres_server(durable=durable) as server:
        yield server.url


@contextmanager
def database_away(server_url: str, db_url: str) -> Iterator[None]:
    """The database of ``db_url`` unreachable for the block, as in an outage: its open
    connections cut and new ones refused (the server itself keeps running)."""
    from sqlalchemy import create_engine, text

    name = db_url.rsplit("/", 1)[1]
    admin = create_engine(server_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f"ALTER DATABASE {name} WITH ALLOW_CONNECTIONS false"))
            conn.execute(
                text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n"),
                {"n": name},
            )
        yield
    finally:
        with admin.connect() as conn:
            conn.execute(text(f"ALTER DATABASE {name} WITH ALLOW_CONNECTIONS true"))
        admin.dispose()
