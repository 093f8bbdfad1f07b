"""Engines and sessions. SQLite gets WAL and a busy timeout so the API, the controller and
training drivers (separate processes) can share one file."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any

import orjson
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()


def _json_dumps(value: Any) -> str:
    return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode()


# JSON columns (job specs, plans, requests) are encoded and decoded on every job written
# or listed; orjson does it several times faster than the standard library.
_JSON = {"json_serializer": _json_dumps, "json_deserializer": orjson.loads}


@lru_cache(maxsize=8)
def get_engine(url: str) -> Engine:
    """One engine per URL per process."""
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            url, connect_args={"check_same_thread": False, "timeout": 30}, **_JSON
        )
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    # No pool_pre_ping: it costs a round trip per checkout, on every request. Connections
    # a server dropped are replaced after an error (SQLAlchemy invalidates them) and
    # recycled hourly.
    return create_engine(url, pool_size=10, max_overflow=20, pool_recycle=3600, **_JSON)


@lru_cache(maxsize=8)
def session_factory(url: str) -> sessionmaker[Session]:
    return sessionmaker(bind=get_engine(url), expire_on_commit=False)


@lru_cache(maxsize=8)
def single_statement_sessions(url: str) -> sessionmaker[Session]:
    """Sessions for requests that only read, or write with a single statement (job
    creation, see ``platform/_new_job.py``). On PostgreSQL they run in autocommit: each statement
    is its own transaction, with no BEGIN, COMMIT or ROLLBACK round trip, and those round
    trips were most of a job creation's time on the API's event loop. SQLite keeps
    transactions: its statements cost no round trip, and a write there may take several."""
    engine = get_engine(url)
    if engine.dialect.name == "postgresql":
        engine = engine.execution_options(isolation_level="AUTOCOMMIT")
    return sessionmaker(bind=engine, expire_on_commit=False)


@contextmanager
def session_scope(url: str) -> Iterator[Session]:
    """A session that commits on success and rolls back on error."""
    session = session_factory(url)()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()
