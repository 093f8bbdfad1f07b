"""Eval runs (``platform/eval_runs.py``), a step of the controller's pass.

Each pass starts a thread for every queued or in-progress run that has none (at most
``MAX_RUNS`` at once, oldest first), once the Serve application of its base model is
deployed (``Serving.ensure_served``: a run on a base nobody serves yet starts it). A run's
thread samples its items through the same serving path the chat API forwards to (the base
model's Serve application, the adapter named in the header Serve routes on), at most
``CONCURRENCY`` requests at a time. Runs of several fine-tuned models of one base therefore
go through one multi-LoRA engine together: their requests share its batches.

Each output item is written once: the insert is unique per (run, item) and fenced by the
controller lease, so a run taken over by a new leader after a crash samples only the items
not yet written, and its counts are summed from the rows, never kept in memory. A serving
failure that is not the item's own (Serve unreachable, a replica restarting, 5xx) ends the
thread without a write; the run is taken up again ``RETRY_S`` later. A cancelled or deleted
run stops at its next item.

Fair share: eval runs use serving replicas, never training workers, so a fine-tuning job
never waits for one; on the replicas a run has at most ``CONCURRENCY`` requests in flight,
so tenants' own traffic keeps its share of every batch.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import httpx
from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from tunefleet.platform.db import Eval, EvalOutputItem, EvalRun, session_scope
from tunefleet.platform.eval_runs import (
    ACTIVE,
    CANCELED,
    COMPLETED,
    DEFAULT_SAMPLING,
    FAILED,
    IN_PROGRESS,
    QUEUED,
    grade,
    messages_for,
    parse_criteria,
    python_sandbox,
    sample_text,
    summary,
)
from tunefleet.platform.graders import GraderFailed
from tunefleet.platform.ids import new_id
from tunefleet.platform.lease import LeaseLost
from tunefleet.platform.serving_contract import (
    ADAPTER_HEADER,
    SECRET_HEADER,
    route_prefix,
    serve_secret,
)
from tunefleet.platform.settings import Settings
from tunefleet.workers._steps import failpoint

log = logging.getLogger(__name__)

MAX_RUNS = 8  # runs sampled at once, across all tenants
CONCURRENCY = 16  # requests in flight per run
RETRY_S = 5.0  # after a serving failure that is not the item's own
COUNTS_EVERY_S = 2.0  # how often a running run's counts are written


class Transient(Exception):
    """Serving could not answer for a reason that is not the item's: try the run later."""


class EvalRuns:
    def __init__(
        self,
        settings: Settings,
        db_url: str,
        writing: Callable[[], contextlib.AbstractContextManager[Session]],
        ensure_served: Callable[[str], bool],
    ):
        self.settings = settings
        self.db_url = db_url
        self._writing = writing
        self._ensure_served = ensure_served
        self._threads: dict[str, threading.Thread] = {}
        self._retry_at: dict[str, float] = {}
        self._stop = threading.Event()

    def close(self) -> None:
        """Stop every run's thread at its next item (the run stays in progress: the next
        leader takes it up)."""
        self._stop.set()

    def wait(self, timeout: float | None = None) -> None:
        """Until every run's thread has ended (tests)."""
        for thread in list(self._threads.values()):
            thread.join(timeout)

    def run(self) -> None:
        """Start a thread for each run that waits for one."""
        self._threads = {k: t for k, t in self._threads.items() if t.is_alive()}
        with session_scope(self.db_url) as s:
            rows = list(
                s.execute(
                    select(EvalRun.id, EvalRun.base_model)
                    .where(EvalRun.status.in_(ACTIVE))
                    .order_by(EvalRun.created_ns, EvalRun.id)
                )
            )
        now = time.monotonic()
        for run_id, base in rows:
            if run_id in self._threads or now < self._retry_at.get(run_id, 0.0):
                continue
            if len(self._threads) >= MAX_RUNS:
                break
            try:
                if base and not self._ensure_served(base):
                    continue  # its model server is starting: a later pass
            except Exception as exc:  # the deploy failed; tried again after its retry delay
                log.warning("eval run %s waits for serving: %s", run_id, exc)
                continue
            thread = threading.Thread(
                target=self._run_one, args=(run_id,), daemon=True, name=f"eval-{run_id}"
            )
            self._threads[run_id] = thread
            thread.start()

    # -- one run ---------------------------------------------------------------------
    def _run_one(self, run_id: str) -> None:
        try:
            self.execute(run_id)
        except LeaseLost:
            log.info("eval run %s: the lease was lost; the next leader goes on with it", run_id)
        except Transient as exc:
            log.warning("eval run %s: %s; trying again in %.0fs", run_id, exc, RETRY_S)
            self._retry_at[run_id] = time.monotonic() + RETRY_S
        except Exception as exc:
            log.exception("eval run %s failed", run_id)
            with self._writing() as s:
                s.execute(
                    update(EvalRun)
                    .where(EvalRun.id == run_id, EvalRun.status.in_(ACTIVE))
                    .values(
                        status=FAILED,
                        error={"code": "run_failed", "message": f"{type(exc).__name__}: {exc}"},
                        updated_ns=time.time_ns(),
                    )
                )

    def execute(self, run_id: str) -> None:
        """Sample and grade every item of the run not yet written, then complete it."""
        with self._writing() as s:
            s.execute(
                update(EvalRun)
                .where(EvalRun.id == run_id, EvalRun.status == QUEUED)
                .values(status=IN_PROGRESS, updated_ns=time.time_ns())
            )
        with session_scope(self.db_url) as s:
            run = s.get(EvalRun, run_id)
            found = s.get(Eval, run.eval_id) if run is not None else None
            if run is None or found is None or run.status != IN_PROGRESS:
                return
            job = _RunJob(
                run_id=run_id,
                items=list(run.items),
                data_source=dict(run.data_source),
                model=run.model,
                base=run.base_model,
                adapter_id=run.adapter_id,
                stored=list(found.testing_criteria),
            )
            done = set(
                s.scalars(select(EvalOutputItem.item_index).where(EvalOutputItem.run_id == run_id))
            )
        criteria = parse_criteria(job.stored)
        python = python_sandbox(self.settings)
        todo = [i for i in range(len(job.items)) if i not in done]
        last_counts = time.monotonic()
        with _client() as client, futures.ThreadPoolExecutor(CONCURRENCY) as pool:
            pending: set[futures.Future[None]] = set()
            for index in todo:
                if len(pending) >= CONCURRENCY:
                    finished, pending = futures.wait(pending, return_when="FIRST_COMPLETED")
                    for f in finished:
                        f.result()  # a Transient or LeaseLost ends the run's thread
                    if time.monotonic() - last_counts > COUNTS_EVERY_S:
                        if not self._counts(job, final=False):
                            return
                        last_counts = time.monotonic()
                if self._stop.is_set():
                    return
                pending.add(pool.submit(self._item, job, criteria, python, client, index))
            for f in futures.as_completed(pending):
                f.result()
        self._counts(job, final=True)

    def _active(self, run_id: str) -> bool:
        with session_scope(self.db_url) as s:
            return s.scalar(select(EvalRun.status).where(EvalRun.id == run_id)) == IN_PROGRESS

    def _counts(self, job: _RunJob, *, final: bool) -> bool:
        """Write the run's counts summed from its rows (and complete it when ``final``);
        whether it is still in progress."""
        with self._writing() as s:
            rows = s.execute(
                select(EvalOutputItem.status, EvalOutputItem.results, EvalOutputItem.sample).where(
                    EvalOutputItem.run_id == job.run_id
                )
            )
            counts, per, usage = summary(job.stored, [tuple(r) for r in rows])
            counts["total"] = len(job.items)
            values: dict[str, Any] = {
                "result_counts": counts,
                "per_testing_criteria_results": per,
                "per_model_usage": usage,
                "updated_ns": time.time_ns(),
            }
            ran = update(EvalRun).where(EvalRun.id == job.run_id)
            moved = s.execute(
                ran.where(EvalRun.status == IN_PROGRESS).values(
                    **values, **({"status": COMPLETED} if final else {})
                )
            )
            if not moved.rowcount:  # type: ignore[attr-defined]
                # cancelled: its counts are of the items graded before it stopped
                s.execute(ran.where(EvalRun.status == CANCELED).values(**values))
        return bool(moved.rowcount)  # type: ignore[attr-defined]

    def _item(
        self,
        job: _RunJob,
        criteria: list[Any],
        python: Any,
        client: httpx.Client,
        index: int,
    ) -> None:
        if self._stop.is_set() or not self._active(job.run_id):
            return
        row = job.items[index]
        item = row["item"]
        sample: dict[str, Any] | None
        results: list[dict[str, Any]]
        if job.base:
            sample = self._sample(job, client, item)
            text = (sample["output"][0]["content"] or "") if sample["output"] else ""
        else:  # jsonl: the sample is the item's own
            sample = row.get("sample")
            text = sample_text(sample) or ""
        if job.base and sample is not None and sample["error"] is not None:
            status, results = "error", []
        else:
            status, results = grade(criteria, job.stored, item, text, python)
        try:
            with self._writing() as s:
                if s.get(EvalRun, job.run_id) is None:
                    return  # deleted meanwhile
                s.add(
                    EvalOutputItem(
                        id=new_id("output_item"),
                        run_id=job.run_id,
                        item_index=index,
                        status=status,
                        datasource_item=item,
                        sample=sample,
                        results=results,
                        created_ns=time.time_ns(),
                    )
                )
                s.flush()
        except IntegrityError:  # written already (a leader before this one): kept as it is
            log.info("eval run %s: item %d was written already", job.run_id, index)
            return
        failpoint("evals.after_item")

    def _sample(self, job: _RunJob, client: httpx.Client, item: Any) -> dict[str, Any]:
        """The model's answer to the item's messages, as OpenAI's output item holds it; an
        answer refusing the item itself (a 4xx) is the sample's ``error``."""
        params = {**DEFAULT_SAMPLING, **(job.data_source.get("sampling_params") or {})}
        try:
            messages = messages_for(job.data_source["input_messages"], item)
        except GraderFailed as exc:  # checked at create: only a changed template gets here
            return _sample(job.model, [], params, error=("invalid_template", str(exc)))
        body = {"model": job.model, "messages": messages, **params}
        headers = {SECRET_HEADER: serve_secret(self.settings)}
        if job.adapter_id:
            headers[ADAPTER_HEADER] = job.adapter_id
        url = f"{self.settings.serve_url}{route_prefix(job.base)}/v1/chat/completions"
        try:
            resp = client.post(url, json=body, headers=headers)
        except httpx.TransportError as exc:
            raise Transient(f"serving is not reachable at {url} ({type(exc).__name__})") from exc
        answer = _json(resp)
        error = answer.get("error") if isinstance(answer, dict) else None
        if (
            resp.status_code >= 500
            or resp.status_code in (401, 403)
            or not isinstance(answer, dict)
        ):
            raise Transient(f"serving answered {resp.status_code} {resp.text[:200]!r}")
        if resp.status_code >= 400 or isinstance(error, dict):
            message = error.get("message", "") if isinstance(error, dict) else resp.text[:500]
            code = (error.get("code") if isinstance(error, dict) else None) or "serving_error"
            return _sample(job.model, messages, params, error=(str(code), str(message)))
        choice = answer["choices"][0]
        usage = answer.get("usage") or {}
        out = _sample(job.model, messages, params)
        out["output"] = [{"role": "assistant", "content": choice["message"].get("content")}]
        out["finish_reason"] = choice.get("finish_reason")
        out["usage"] = {
            "prompt_tokens": int(usage.get("prompt_tokens") or 0),
            "completion_tokens": int(usage.get("completion_tokens") or 0),
            "total_tokens": int(usage.get("total_tokens") or 0),
            "cached_tokens": int(
                (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            ),
        }
        return out


class _RunJob:
    """What a run's thread reads once: its items, data source, model and criteria."""

    def __init__(self, **kw: Any) -> None:
        self.run_id: str = kw["run_id"]
        self.items: list[dict[str, Any]] = kw["items"]
        self.data_source: dict[str, Any] = kw["data_source"]
        self.model: str = kw["model"]
        self.base: str = kw["base"]
        self.adapter_id: str = kw["adapter_id"]
        self.stored: list[dict[str, Any]] = kw["stored"]


def _sample(
    model: str,
    messages: list[dict[str, str]],
    params: dict[str, Any],
    *,
    error: tuple[str, str] | None = None,
) -> dict[str, Any]:
    return {
        "model": model,
        "input": messages,
        "output": [],
        "finish_reason": None,
        "usage": None,
        "error": None if error is None else {"code": error[0], "message": error[1]},
        "temperature": params.get("temperature"),
        "top_p": params.get("top_p"),
        "seed": params.get("seed"),
        "max_completion_tokens": params.get("max_completion_tokens"),
    }


def _json(resp: httpx.Response) -> Any:
    try:
        return resp.json()
    except ValueError:
        return None


@contextlib.contextmanager
def _client() -> Iterator[httpx.Client]:
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    with httpx.Client(timeout=httpx.Timeout(600.0, connect=5.0), limits=limits) as client:
        yield client
