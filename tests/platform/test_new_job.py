"""Storing a new job (``_new_job.insert_job`` through ``jobs.create_job``): SQLite and
PostgreSQL store the same row and first event, answer with what they stored, store nothing
when a file is unusable or the tenant's waiting jobs are at its cap, and write once."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import hypothesis
import pytest
from hypothesis import strategies as st
from sqlalchemy import event, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from conftest import add_chat_file
from tunefleet.platform.artifacts import ArtifactStore
from tunefleet.platform.db import File, Job, JobEvent, session_scope, single_statement_sessions
from tunefleet.platform.errors import InvalidRequest, NotFound, QuotaExceeded
from tunefleet.platform.jobs import JOB_COLUMNS, JobCreateRequest, create_job
from tunefleet.platform.models import ModelRegistry
from tunefleet.platform.settings import Settings
from tunefleet.platform.tenants import Principal, authenticate, create_key, create_tenant

REQUEST = {
    "model": "tiny-llama",
    "training_file": "f-train",
    "validation_file": "f-valid",
    "suffix": "same",
    "seed": 5,
    "metadata": {"team": "search"},
    "hyperparameters": {"n_epochs": 2, "batch_size": 4},
}


@pytest.fixture
def tenant(settings: Settings) -> Principal:
    url = settings.resolved_database_url
    store = ArtifactStore(settings.resolved_artifact_root)
    with session_scope(url) as s:
        t = create_tenant(s, "acme")
        principal = authenticate(s, f"Bearer {create_key(s, t.id)[1]}")
        add_chat_file(s, store, t.id, "f-train", 8)
        add_chat_file(s, store, t.id, "f-valid", 2)
    return principal


@pytest.fixture
def session(settings: Settings) -> Iterator[Session]:
    """The session the API's create route gets: autocommit on PostgreSQL."""
    with single_statement_sessions(settings.resolved_database_url)() as s:
        yield s


def _create(
    s: Session, settings: Settings, principal: Principal, body: dict[str, Any], **kw: Any
) -> Any:
    registry = ModelRegistry(settings.resolved_model_registry)
    row = create_job(s, principal, JobCreateRequest.model_validate(body), registry, **kw)
    s.commit()
    return row


def _counts(settings: Settings) -> tuple[int, int]:
    with session_scope(settings.resolved_database_url) as s:
        return (
            s.scalar(select(func.count()).select_from(Job)) or 0,
            s.scalar(select(func.count()).select_from(JobEvent)) or 0,
        )


def test_both_databases_store_the_same_job_and_first_event_and_answer_with_it(
    settings: Settings, tenant: Principal, session: Session
) -> None:
    answered = _create(session, settings, tenant, REQUEST, idempotency_key="k-1")
    with session_scope(settings.resolved_database_url) as s:
        stored = s.execute(select(*JOB_COLUMNS).where(Job.id == answered.id)).one()
        events = s.scalars(select(JobEvent).where(JobEvent.job_id == answered.id)).all()
    # The answer is the stored row, column for column (defaults included).
    assert answered._asdict() == stored._asdict()
    # What both databases hold, ids and times aside.
    varying = {"id", "created_at", "created_ns", "updated_at", "spec", "request", "plan"}
    assert {k: v for k, v in stored._asdict().items() if k not in varying} == {
        "tenant_id": tenant.tenant_id,
        "status": "validating_files",
        "model": "tiny-llama",
        "training_file": "f-train",
        "validation_file": "f-valid",
        "fine_tuned_model": None,
        "metadata_": {"team": "search"},
        "error": None,
        "trained_tokens": None,
        "estimated_finish": None,
        "result_files": [],
        "stats": None,
        "priority": 0,
        "attempt": 0,
        "ray_submission_id": None,
        "idempotency_key": "k-1",
        "finished_at": None,
        "failures": 0,
        "not_before": None,
        "placement": None,
        "reported": None,
    }
    assert stored.request == REQUEST
    assert stored.spec["hyperparameters"]["n_epochs"] == 2
    assert stored.spec["seed"] == 5
    assert stored.plan is None  # no device given
    assert stored.created_at == stored.updated_at == stored.created_ns // 1_000_000_000
    [first] = events
    assert (first.level, first.type) == ("info", "message")
    assert first.message.startswith(f"Created fine-tuning job: {answered.id}")
    assert first.created_at == stored.created_at


def test_nothing_is_stored_when_a_file_is_unusable(
    settings: Settings, tenant: Principal, session: Session
) -> None:
    with session_scope(settings.resolved_database_url) as s:
        s.get_one(File, "f-valid").status = "error"
        add_chat_file(
            s, ArtifactStore(settings.resolved_artifact_root), tenant.tenant_id, "f-dpo", 1
        )
        s.get_one(File, "f-dpo").format = "preference"
    cases: list[tuple[dict[str, Any], type[Exception], str]] = [
        ({"training_file": "f-none"}, NotFound, "no file with id 'f-none'"),
        ({"validation_file": "f-valid"}, InvalidRequest, "f-valid is error, not processed"),
        ({"training_file": "f-dpo"}, InvalidRequest, "f-dpo holds preference pairs"),
    ]
    for change, error, says in cases:
        with pytest.raises(error, match=says):
            _create(session, settings, tenant, {**REQUEST, **change})
        session.rollback()
    assert _counts(settings) == (0, 0)


def test_nothing_is_stored_past_the_waiting_cap(
    settings: Settings, tenant: Principal, session: Session
) -> None:
    capped = dataclasses.replace(tenant, max_waiting_jobs=2)
    _create(session, settings, capped, REQUEST)
    _create(session, settings, capped, REQUEST)
    with pytest.raises(QuotaExceeded, match="has 2 jobs waiting to run"):
        _create(session, settings, capped, REQUEST)
    assert _counts(settings) == (2, 2)


CONCURRENT = 32


@hypothesis.settings(
    max_examples=5,
    deadline=None,
    suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture],
)
@hypothesis.given(cap=st.integers(1, 40), already=st.integers(0, 40))
def test_the_waiting_cap_holds_under_32_concurrent_creates(
    settings: Settings, tenant: Principal, session: Session, cap: int, already: int
) -> None:
    """With ``already`` jobs waiting, 32 creates at once from the tenant store exactly as
    many as its cap leaves room for, and refuse the others with 429: on PostgreSQL each
    create counts every job created before it (its row lock orders them), not only those
    committed when it began."""
    hypothesis.assume(already <= cap)
    url = settings.resolved_database_url
    with session_scope(url) as s:  # the examples before this one are cancelled
        s.execute(update(Job).values(status="cancelled"))
    capped = dataclasses.replace(tenant, max_waiting_jobs=cap)
    for _ in range(already):
        _create(session, settings, capped, REQUEST)
    start = threading.Barrier(CONCURRENT)

    def create(_: int) -> str:
        with single_statement_sessions(url)() as s:
            start.wait()
            try:
                _create(s, settings, capped, REQUEST)
            except QuotaExceeded as exc:
                assert exc.code == "too_many_waiting_jobs", exc
                return "refused"
            return "stored"

    with ThreadPoolExecutor(CONCURRENT) as pool:
        answers = list(pool.map(create, range(CONCURRENT)))
    room = min(CONCURRENT, cap - already)
    assert answers.count("stored") == room, (cap, already, answers)
    assert answers.count("refused") == CONCURRENT - room
    with session_scope(url) as s:
        waiting = s.scalar(
            select(func.count())
            .select_from(Job)
            .where(Job.status.in_(("validating_files", "queued")))
        )
    assert waiting == already + room


def test_an_idempotency_key_clash_stores_nothing(
    settings: Settings, tenant: Principal, session: Session
) -> None:
    _create(session, settings, tenant, REQUEST, idempotency_key="k-1")
    with pytest.raises(IntegrityError):
        _create(session, settings, tenant, REQUEST, idempotency_key="k-1")
    session.rollback()
    assert _counts(settings) == (1, 1)


def test_creation_writes_once_on_postgresql_and_in_one_transaction_on_sqlite(
    settings: Settings, tenant: Principal, session: Session
) -> None:
    """The hot route's session is in autocommit on PostgreSQL: a second write added to
    creation would be a transaction of its own, and a crash between the two would leave a
    job without its first event. Keep creation's writes in ``_new_job.insert_job``."""
    writes: list[str] = []

    def count(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if statement.lstrip().split(None, 1)[0].upper() in {"INSERT", "UPDATE", "DELETE", "WITH"}:
            writes.append(statement)

    engine = session.get_bind()
    event.listen(engine, "before_cursor_execute", count)
    try:
        registry = ModelRegistry(settings.resolved_model_registry)
        create_job(session, tenant, JobCreateRequest.model_validate(REQUEST), registry)
        if engine.dialect.name == "postgresql":
            assert len(writes) == 1, writes
        else:
            assert len(writes) == 2, writes  # the job, then its event
            assert session.in_transaction()
        session.commit()
    finally:
        event.remove(engine, "before_cursor_execute", count)
    assert _counts(settings) == (1, 1)


def test_a_dpo_job_is_stored_on_preference_files_only(
    settings: Settings, tenant: Principal, session: Session
) -> None:
    with session_scope(settings.resolved_database_url) as s:
        store = ArtifactStore(settings.resolved_artifact_root)
        add_chat_file(s, store, tenant.tenant_id, "f-pairs", 4, preference=True)
    dpo = {**REQUEST, "method": {"type": "dpo"}}
    cases = [
        ({}, "file f-train holds chat examples, and a DPO job trains on preference pairs"),
        ({"training_file": "f-pairs"}, "file f-valid holds chat examples"),
    ]
    for change, says in cases:
        with pytest.raises(InvalidRequest, match=says):
            _create(session, settings, tenant, {**dpo, **change})
        session.rollback()
    assert _counts(settings) == (0, 0)
    row = _create(
        session, settings, tenant, {**dpo, "training_file": "f-pairs", "validation_file": "f-pairs"}
    )
    assert row.spec["objective"] == "dpo" and row.spec["dpo"]["beta"] == 0.1
    assert _counts(settings) == (1, 1)
