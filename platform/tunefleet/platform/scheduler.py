"""The scheduling policy: which queued jobs start now, where, and why the others wait.

``plan(snapshot, now)`` is a pure function of a snapshot of the queue, the running jobs,
the tenants' quotas and the cluster's nodes; it returns decisions and touches nothing. The
controller builds the snapshot from the database and Ray and applies the decisions.

The rules, in order:

1. **Admission.** A job whose gang (all its workers) could not be placed even on an empty
   cluster is rejected with what it asked for and what the largest node has. A job in
   retry backoff (``not_before`` in the future) waits.
2. **Priority classes.** Higher ``priority`` is considered first, whole class by class.
3. **Fair share.** Within a class, the next job considered is the oldest of the tenant
   with the smallest *weighted dominant share*: the larger of its running CPU and GPU
   fractions of the cluster, divided by its weight (its quota of concurrent jobs). Each
   dispatch raises that tenant's share, so tenants alternate and none starves another
   (weighted DRF, as in Ghodsi et al. 2011 and YARN's DominantResourceCalculator).
4. **Quotas.** A tenant at its ``max_concurrent_jobs`` or whose ``max_gpus`` the job would
   pass waits, without holding anyone else up.
5. **Gang placement.** All of a job's workers are placed on nodes' free CPUs/GPUs, or
   none is (best fit per worker: the node that leaves the least room, keeping large gaps
   for large jobs). The run itself gets its workers from one Ray placement group.
6. **Backfill.** A job that does not fit now does not stop a smaller job of the same class
   behind it from starting in the gap, unless it has waited ``starvation_s``: then it
   reserves, and nothing ranked after it starts until it does. A job that does not fit
   also stops all lower classes (priority means waiting for capacity first).

Queue positions count the waiting jobs in the order they were considered, so the
position a job is told is its place in the order the policy would start them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

STARVATION_S = 600.0


@dataclass(frozen=True)
class Node:
    """A Ray node: its total and currently free (not held by TuneFleet runs) resources."""

    id: str
    cpus: float
    gpus: float = 0.0
    free_cpus: float | None = None
    free_gpus: float | None = None

    @property
    def free(self) -> tuple[float, float]:
        return (
            self.cpus if self.free_cpus is None else self.free_cpus,
            self.gpus if self.free_gpus is None else self.free_gpus,
        )


@dataclass(frozen=True)
class QueuedJob:
    id: str
    tenant_id: str
    created_ns: int
    priority: int = 0
    workers: int = 1
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    not_before: float | None = None  # seconds since the epoch

    @property
    def cpus(self) -> float:
        return self.workers * self.cpus_per_worker

    @property
    def gpus(self) -> float:
        return self.workers * self.gpus_per_worker


@dataclass(frozen=True)
class RunningJob:
    id: str
    tenant_id: str
    cpus: float
    gpus: float = 0.0


@dataclass(frozen=True)
class TenantQuota:
    id: str
    max_concurrent_jobs: int = 4
    max_gpus: float = 8.0

    @property
    def weight(self) -> float:
        return float(max(1, self.max_concurrent_jobs))


@dataclass(frozen=True)
class Snapshot:
    queued: Sequence[QueuedJob]
    running: Sequence[RunningJob]
    tenants: dict[str, TenantQuota]
    nodes: Sequence[Node]
    starvation_s: float = STARVATION_S


@dataclass(frozen=True)
class Dispatch:
    job_id: str
    nodes: tuple[str, ...]  # one node id per worker


@dataclass(frozen=True)
class Wait:
    job_id: str
    position: int
    reason: str


@dataclass(frozen=True)
class Reject:
    job_id: str
    reason: str


Decision = Dispatch | Wait | Reject


@dataclass
class _Usage:
    cpus: float = 0.0
    gpus: float = 0.0
    jobs: int = 0


@dataclass
class _State:
    free: dict[str, list[float]]  # node id -> [free cpus, free gpus]
    usage: dict[str, _Usage] = field(default_factory=dict)


def plan(snapshot: Snapshot, now: float) -> list[Decision]:
    """Decide, for every queued job, whether it starts now (and on which nodes), waits
    (at which position, why) or can never run on this cluster."""
    total_cpus = sum(n.cpus for n in snapshot.nodes) or 1.0
    total_gpus = sum(n.gpus for n in snapshot.nodes)
    state = _State(free={n.id: list(n.free) for n in snapshot.nodes})
    for r in snapshot.running:
        u = state.usage.setdefault(r.tenant_id, _Usage())
        u.cpus, u.gpus, u.jobs = u.cpus + r.cpus, u.gpus + r.gpus, u.jobs + 1

    decisions: list[Decision] = []
    waiting: list[tuple[QueuedJob, str]] = []
    eligible: list[QueuedJob] = []
    empty = {n.id: [n.cpus, n.gpus] for n in snapshot.nodes}
    fits_empty: dict[tuple[int, float, float], bool] = {}  # by gang shape
    for job in snapshot.queued:
        shape = (job.workers, job.cpus_per_worker, job.gpus_per_worker)
        if shape not in fits_empty:
            fits_empty[shape] = _place(job, {k: list(v) for k, v in empty.items()}) is not None
        if not fits_empty[shape]:
            decisions.append(Reject(job.id, _never_fits(job, snapshot.nodes)))
        elif job.not_before is not None and job.not_before > now:
            waiting.append((job, f"retrying after a failed run in {job.not_before - now:.0f}s"))
        else:
            eligible.append(job)

    def share(tenant_id: str) -> float:
        u = state.usage.get(tenant_id, _Usage())
        dominant = max(u.cpus / total_cpus, u.gpus / total_gpus if total_gpus else 0.0)
        quota = snapshot.tenants.get(tenant_id, TenantQuota(tenant_id))
        return dominant / quota.weight

    blocked_class = False  # a job of a higher class waits for capacity
    for priority in sorted({j.priority for j in eligible}, reverse=True):
        queues: dict[str, deque[QueuedJob]] = {}
        for job in sorted(
            (j for j in eligible if j.priority == priority), key=lambda j: (j.created_ns, j.id)
        ):
            queues.setdefault(job.tenant_id, deque()).append(job)
        reserved: QueuedJob | None = None
        short_of_capacity = False
        while queues:
            tenant_id = min(queues, key=lambda t: (share(t), queues[t][0].created_ns, t))
            job = queues[tenant_id].popleft()
            if not queues[tenant_id]:
                del queues[tenant_id]
            reason = _quota_block(job, snapshot.tenants, state)
            if reason is None and blocked_class:
                reason = "a job of a higher priority is waiting for capacity"
            if reason is None and reserved is not None:
                reason = f"capacity is reserved for {reserved.id}, which has waited longest"
            placement = _place(job, state.free) if reason is None else None
            if placement is not None:
                decisions.append(Dispatch(job.id, placement))
                u = state.usage.setdefault(job.tenant_id, _Usage())
                u.cpus, u.gpus, u.jobs = u.cpus + job.cpus, u.gpus + job.gpus, u.jobs + 1
                continue
            if reason is None:
                reason = (
                    f"waiting for {job.workers} worker(s) of {job.cpus_per_worker:g} CPU"
                    f"/{job.gpus_per_worker:g} GPU to be free at once"
                )
                short_of_capacity = True
                if now - job.created_ns / 1e9 >= snapshot.starvation_s:
                    reserved = job
            waiting.append((job, reason))
        blocked_class = blocked_class or short_of_capacity

    decisions.extend(Wait(job.id, i + 1, reason) for i, (job, reason) in enumerate(waiting))
    return decisions


def _quota_block(job: QueuedJob, tenants: dict[str, TenantQuota], state: _State) -> str | None:
    quota = tenants.get(job.tenant_id, TenantQuota(job.tenant_id))
    u = state.usage.get(job.tenant_id, _Usage())
    if u.jobs >= quota.max_concurrent_jobs:
        return f"tenant is at its quota of {quota.max_concurrent_jobs} concurrent job(s)"
    if u.gpus + job.gpus > quota.max_gpus:
        return f"tenant would pass its quota of {quota.max_gpus:g} GPUs"
    return None


def _place(job: QueuedJob, free: dict[str, list[float]]) -> tuple[str, ...] | None:
    """Best-fit every worker of the gang onto ``free`` (changed in place only when the
    whole gang fits); None when some worker has nowhere to go."""
    if (
        sum(cpus for cpus, _ in free.values()) < job.cpus - 1e-9
        or sum(gpus for _, gpus in free.values()) < job.gpus - 1e-9
    ):
        return None  # not even the cluster's total free capacity holds it
    taken: dict[str, int] = {}  # workers put on each node so far
    nodes: list[str] = []
    c, g = job.cpus_per_worker, job.gpus_per_worker
    for _ in range(job.workers):
        best: tuple[float, str] | None = None
        for node_id, (cpus, gpus) in free.items():
            n = taken.get(node_id, 0)
            left_c, left_g = cpus - (n + 1) * c, gpus - (n + 1) * g
            if (
                left_c >= -1e-9
                and left_g >= -1e-9
                and (best is None or (left_c + left_g, node_id) < best)
            ):
                best = (left_c + left_g, node_id)
        if best is None:
            return None
        taken[best[1]] = taken.get(best[1], 0) + 1
        nodes.append(best[1])
    for node_id, n in taken.items():
        free[node_id][0] -= n * c
        free[node_id][1] -= n * g
    return tuple(nodes)


def _never_fits(job: QueuedJob, nodes: Iterable[Node]) -> str:
    nodes = list(nodes)
    if not nodes:
        return "the cluster has no nodes"
    biggest = max(nodes, key=lambda n: (n.gpus, n.cpus))
    return (
        f"the job asks for {job.workers} worker(s) of {job.cpus_per_worker:g} CPU and "
        f"{job.gpus_per_worker:g} GPU each ({job.cpus:g} CPU, {job.gpus:g} GPU in all); the "
        f"cluster has {len(nodes)} node(s), the largest with {biggest.cpus:g} CPU and "
        f"{biggest.gpus:g} GPU, {sum(n.cpus for n in nodes):g} CPU and "
        f"{sum(n.gpus for n in nodes):g} GPU in all; lower tunefleet.resources"
    )


# -- after a run: retry or give up ------------------------------------------------------

# A failed run is retried after RETRY_BASE_S, then twice as long each time, at most
# RETRY_MAX_S; the job fails at its MAX_RUN_FAILURES-th failed run.
MAX_RUN_FAILURES = 3
RETRY_BASE_S = 10
RETRY_MAX_S = 300
# Failures a run records that the next run would meet again: the job fails at once.
NOT_RETRIED = frozenset({"disk_full"})


@dataclass(frozen=True)
class Retry:
    """Run the job again after ``delay_s``; ``failures`` counts this one."""

    failures: int
    delay_s: int


def after_failure(failures: int, recorded_code: str | None = None) -> Retry | None:
    """What follows a failed run (or a submit Ray refused) of a job that had failed
    ``failures`` times before: a retry after a backoff that doubles, or None when the job
    fails (its MAX_RUN_FAILURES-th failure, or one the run recorded as ``NOT_RETRIED``)."""
    if recorded_code in NOT_RETRIED or failures + 1 >= MAX_RUN_FAILURES:
        return None
    return Retry(failures + 1, min(RETRY_MAX_S, RETRY_BASE_S * 2**failures))


def serving_mode(method: str) -> str:
    """How a new adapter of ``method`` is served: (IA)^3 vectors scale activations, which
    batched LoRA serving cannot apply, so it is merged into its own copy of the base; every
    other method is batched (``multiplexed``)."""
    return "merged" if method == "ia3" else "multiplexed"
