"""Admission, the controller's first step on a job: count each new job's files in its
base model's tokens, then queue it (``validating_files -> queued``), or fail it with the
reason when a file cannot be used.

Counting runs on the admission thread, off the pass: a pass hands it the new jobs, waits
for them up to ``ADMISSION_WAIT_S`` (small files are done by then), and takes the rest on
a later pass, so one tenant's large file never holds up the others' dispatch or the
lease's renewal. A file whose counting runs past ``ADMISSION_TIMEOUT_S`` fails its job.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any

from pydantic import ValidationError
from sqlalchemy import select

from tunefleet.platform.artifacts import Store
from tunefleet.platform.db import Job, session_scope
from tunefleet.platform.models import ModelRegistry
from tunefleet.platform.spec import JobSpec
from tunefleet.platform.status import JobStatus, transition
from tunefleet.workers._steps import Writing, fail_unreadable, moved_on

S = JobStatus


class Admission:
    """The admission thread and the counts in flight on it."""

    # A pass waits this long for the files it handed to the admission thread.
    ADMISSION_WAIT_S = 2.0
    # Counting one job's files in tokens may take this long, then the job fails.
    ADMISSION_TIMEOUT_S = 900.0

    def __init__(self, store: Store, registry: ModelRegistry, db_url: str, writing: Writing):
        self.store = store
        self.registry = registry
        self.db_url = db_url
        self.writing = writing
        self._tokenizers: dict[str, Any] = {}  # used on the admission thread only
        self._pool = futures.ThreadPoolExecutor(1, thread_name_prefix="admission")
        self._closing = threading.Event()
        self._admitting: dict[str, futures.Future[dict[str, dict[str, int]]]] = {}

    def close(self) -> None:
        """Stop counting (a count in progress stops at its next line) and wait for the
        thread."""
        self._closing.set()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def admit(self) -> None:
        """Hand the new jobs to the admission thread; queue (or fail) those it has
        counted."""
        with session_scope(self.db_url) as s:
            pending = list(s.scalars(select(Job).where(Job.status == S.VALIDATING_FILES.value)))
            for job in pending:
                s.expunge(job)
        waiting = {job.id for job in pending}
        self._admitting = {k: v for k, v in self._admitting.items() if k in waiting}
        for job in pending:
            if job.id in self._admitting:
                continue
            try:
                spec = JobSpec.model_validate(job.spec)
            except ValidationError as exc:  # stored before a bound existed: this job alone
                fail_unreadable(self.writing, job.id, S.VALIDATING_FILES, exc)
                continue
            files = {"training_file": job.training_file, "validation_file": job.validation_file}
            self._admitting[job.id] = self._pool.submit(
                self._count_files, job.model, spec.tunefleet.max_seq_len, files
            )
        futures.wait(list(self._admitting.values()), timeout=self.ADMISSION_WAIT_S)
        for job_id, counted in list(self._admitting.items()):
            if not counted.done():
                continue
            del self._admitting[job_id]
            try:
                stats = counted.result()
            except Exception as exc:  # any unreadable file fails this job, not the loop
                with moved_on(job_id), self.writing() as s:
                    transition(
                        s,
                        job_id,
                        S.VALIDATING_FILES,
                        S.FAILED,
                        f"File validation failed: {exc}",
                        level="error",
                        error={
                            "code": "invalid_file",
                            "message": str(exc),
                            "param": "training_file",
                        },
                    )
                continue
            train = stats["training_file"]
            with moved_on(job_id), self.writing() as s:
                transition(
                    s,
                    job_id,
                    S.VALIDATING_FILES,
                    S.QUEUED,
                    f"Validated training file: {train['examples']} examples, "
                    f"{train['tokens']} tokens, {train['over_max_seq_len']} longer than "
                    f"{train['max_seq_len']} (truncated); job queued",
                    data=stats,
                    stats=stats,
                )

    def _count_files(
        self, model: str, max_seq_len: int, files: dict[str, str | None]
    ) -> dict[str, dict[str, int]]:
        """On the admission thread: each file's token statistics."""
        deadline = time.monotonic() + self.ADMISSION_TIMEOUT_S

        def check() -> None:  # between two lines of a file
            if self._closing.is_set():
                raise RuntimeError("the controller stopped while counting; counted again later")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"counting the files' tokens took longer than {self.ADMISSION_TIMEOUT_S:.0f}"
                    " s; split the training file into smaller jobs"
                )

        stats = {
            role: self._file_stats(file_id, model, max_seq_len, check)
            for role, file_id in files.items()
            if file_id
        }
        if stats["training_file"]["trained_tokens"] == 0:
            raise ValueError(
                "no example has tokens to learn from (assistant turns with weight 1, "
                "completions or text)"
            )
        return stats

    def _file_stats(
        self, file_id: str, model: str, max_seq_len: int, check: Callable[[], None]
    ) -> dict[str, int]:
        from transformers import AutoTokenizer

        from tunefleet.workers.train.data import token_stats

        if model not in self._tokenizers:
            self._tokenizers[model] = AutoTokenizer.from_pretrained(self.registry.require(model))
        with self.store.pinned_copy(self.store.file_key(file_id)) as path:  # kept while read
            if not path.exists():
                raise FileNotFoundError(f"file {file_id} is no longer in the artifact store")
            return token_stats(path, self._tokenizers[model], max_seq_len, check=check)
