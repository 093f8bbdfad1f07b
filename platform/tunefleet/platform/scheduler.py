"""The scheduling policy: which queued jobs start now, where, and why the others wait.

``plan(snapshot, now)`` is a pure function of a snapshot of the queue, the running jobs,
the tenants' quotas and the cluster's nodes; it returns decisions and touches nothing. The
controller builds the snapshot from the database and Ray and applies the decisions.

The rules, in order:

1. **Admission.** A job whose gang (all its workers) could not be placed even on an empty
   cluster grown to its limits (the live nodes, and each node type's ``max_count`` nodes)
   is rejected with what it asked for and what the largest node type has. A job in
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
6. **Growth.** A job that does not fit the live nodes' free capacity but would fit with
   nodes the autoscaler can still add waits for them: its ``Wait`` names the node types
   and counts (``Grow``), which the controller asks Ray's autoscaler for. Those nodes are
   then promised to it: the next job that needs growth counts only what is left.
7. **Backfill.** A job that does not fit now does not stop a smaller job of the same class
   behind it from starting in the gap, unless it has waited ``starvation_s``: then it
   reserves, and nothing ranked after it starts until it does. A job that does not fit
   also stops all lower classes (priority means waiting for capacity first).

Queue positions count the waiting jobs in the order they were considered, so the
position a job is told is its place in the order the policy would start them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from tunefleet.platform.planner import fmt_bytes
from tunefleet.platform.serving_contract import NODE_ROLE_LABEL, NOT_FOR_REPLICAS

STARVATION_S = 600.0


@dataclass(frozen=True)
class Node:
    """A Ray node: its total and currently free (not held by TuneFleet runs) resources.
    ``resources`` are its other Ray resources (an accelerator type, an operator's own);
    ``memory`` is Ray's ``memory`` resource in bytes (a KubeRay pod's memory limit), None
    where not known; ``labels`` its Ray node labels."""

    id: str
    cpus: float
    gpus: float = 0.0
    free_cpus: float | None = None
    free_gpus: float | None = None
    resources: Mapping[str, float] = field(default_factory=dict)
    free_resources: Mapping[str, float] | None = None
    memory: float | None = None
    labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def free(self) -> tuple[float, float]:
        return (
            self.cpus if self.free_cpus is None else self.free_cpus,
            self.gpus if self.free_gpus is None else self.free_gpus,
        )


@dataclass(frozen=True)
class NodeType:
    """A kind of node the cluster can add (an autoscaler's node type, a KubeRay worker
    group): what one node has, how many the group may hold (``max_count``, -1 for no
    limit) and how many of them are up now (``live``). ``memory`` and ``labels`` as for
    ``Node``."""

    name: str
    cpus: float
    gpus: float = 0.0
    resources: Mapping[str, float] = field(default_factory=dict)
    max_count: int = -1
    live: int = 0
    memory: float | None = None
    labels: Mapping[str, str] = field(default_factory=dict)

    def addable(self, wanted: int) -> int:
        """How many more nodes of this type can come, at most ``wanted``."""
        room = wanted if self.max_count < 0 else self.max_count - self.live
        return max(0, min(wanted, room))


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
    resources_per_worker: Mapping[str, float] = field(default_factory=dict)  # others

    @property
    def cpus(self) -> float:
        return self.workers * self.cpus_per_worker

    @property
    def gpus(self) -> float:
        return self.workers * self.gpus_per_worker

    def bundle(self) -> dict[str, float]:
        """What one worker asks of a node, as Ray names the resources."""
        return {
            "CPU": self.cpus_per_worker,
            **({"GPU": self.gpus_per_worker} if self.gpus_per_worker else {}),
            **self.resources_per_worker,
        }

    def bundles(self) -> tuple[dict[str, float], ...]:
        """The gang: one ``bundle`` per worker."""
        return tuple(self.bundle() for _ in range(self.workers))


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
    node_types: Sequence[NodeType] = ()


@dataclass(frozen=True)
class Dispatch:
    job_id: str
    nodes: tuple[str, ...]  # one node id per worker


@dataclass(frozen=True)
class Grow:
    """The nodes a waiting job needs the autoscaler to add (node type -> count), and its
    gang's bundles (one per worker) to ask for."""

    nodes: tuple[tuple[str, int], ...]
    bundles: tuple[dict[str, float], ...]

    def describe(self) -> str:
        return " and ".join(f"{n} node(s) of group {name}" for name, n in self.nodes)


@dataclass(frozen=True)
class Wait:
    job_id: str
    position: int
    reason: str
    grow: Grow | None = None  # set when it waits for the autoscaler


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


# Room on a node, or a worker's ask: one number per resource, in the order of the plan's
# resource names (CPU, GPU, then the others queued jobs name).
Vector = list[float]


@dataclass
class _State:
    free: dict[str, Vector]  # node id -> its free resources
    # nodes the autoscaler can still add and no waiting job was promised: "type#i" ->
    # an empty node of that type
    addable: dict[str, Vector]
    usage: dict[str, _Usage] = field(default_factory=dict)


def plan(snapshot: Snapshot, now: float) -> list[Decision]:
    """Decide, for every queued job, whether it starts now (and on which nodes), waits
    (at which position, why, for which new nodes) or can never run on this cluster."""
    total_cpus = sum(n.cpus for n in snapshot.nodes) or 1.0
    total_gpus = sum(n.gpus for n in snapshot.nodes)
    names = ["CPU", "GPU", *sorted({k for j in snapshot.queued for k in j.resources_per_worker})]

    def vector(cpus: float, gpus: float, other: Mapping[str, float]) -> Vector:
        return [cpus, gpus, *(other.get(k, 0.0) for k in names[2:])]

    def node_free(n: Node) -> Vector:
        return vector(*n.free, n.resources if n.free_resources is None else n.free_resources)

    widest = max((j.workers for j in snapshot.queued), default=0)
    addable = {
        f"{t.name}#{i}": vector(t.cpus, t.gpus, t.resources)
        for t in snapshot.node_types
        for i in range(t.addable(widest))
    }
    state = _State(free={n.id: node_free(n) for n in snapshot.nodes}, addable=addable)
    for r in snapshot.running:
        u = state.usage.setdefault(r.tenant_id, _Usage())
        u.cpus, u.gpus, u.jobs = u.cpus + r.cpus, u.gpus + r.gpus, u.jobs + 1

    decisions: list[Decision] = []
    waiting: list[tuple[QueuedJob, str, Grow | None]] = []
    eligible: list[QueuedJob] = []
    # The cluster empty and grown as far as it can go: every live node, and every node
    # type at its most. A live node of a type counts twice, so a job is rejected only if it
    # can never run: the live nodes and the node types' live counts are read one after the
    # other, and a node that joins between the two reads must not make a job look too big.
    largest = {n.id: vector(n.cpus, n.gpus, n.resources) for n in snapshot.nodes} | {
        f"{t.name}#{i}": vector(t.cpus, t.gpus, t.resources)
        for t in snapshot.node_types
        for i in range(replace(t, live=0).addable(widest))
    }
    fits_largest: dict[tuple[object, ...], bool] = {}  # by gang shape
    for job in snapshot.queued:
        ask = vector(job.cpus_per_worker, job.gpus_per_worker, job.resources_per_worker)
        shape = (job.workers, *ask)
        if shape not in fits_largest:
            room = {k: list(v) for k, v in largest.items()}
            fits_largest[shape] = _place(job.workers, ask, room) is not None
        if not fits_largest[shape]:
            decisions.append(Reject(job.id, _never_fits(job, snapshot)))
        elif job.not_before is not None and job.not_before > now:
            waiting.append(
                (job, f"retrying after a failed run in {job.not_before - now:.0f}s", None)
            )
        else:
            eligible.append(job)

    def share(tenant_id: str) -> float:
        u = state.usage.get(tenant_id, _Usage())
        dominant = max(u.cpus / total_cpus, u.gpus / total_gpus if total_gpus else 0.0)
        quota = snapshot.tenants.get(tenant_id, TenantQuota(tenant_id))
        return dominant / quota.weight

    blocked_class = False  # a job of a higher class waits for capacity
    no_growth: set[tuple[object, ...]] = set()  # gang shapes the addable nodes cannot take
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
            ask = vector(job.cpus_per_worker, job.gpus_per_worker, job.resources_per_worker)
            reason = _quota_block(job, snapshot.tenants, state)
            if reason is None and blocked_class:
                reason = "a job of a higher priority is waiting for capacity"
            if reason is None and reserved is not None:
                reason = f"capacity is reserved for {reserved.id}, which has waited longest"
            placement = _place(job.workers, ask, state.free) if reason is None else None
            if placement is not None:
                decisions.append(Dispatch(job.id, placement))
                u = state.usage.setdefault(job.tenant_id, _Usage())
                u.cpus, u.gpus, u.jobs = u.cpus + job.cpus, u.gpus + job.gpus, u.jobs + 1
                continue
            grow = None
            if reason is None:
                short_of_capacity = True
                if now - job.created_ns / 1e9 >= snapshot.starvation_s:
                    reserved = job
                grow = _grow(job, ask, state, no_growth)
                if grow is not None:
                    reason = f"waiting for the autoscaler to add {grow.describe()}"
                else:
                    reason = (
                        f"waiting for {job.workers} worker(s) of {job.cpus_per_worker:g} CPU"
                        f"/{job.gpus_per_worker:g} GPU to be free at once"
                    )
            waiting.append((job, reason, grow))
        blocked_class = blocked_class or short_of_capacity

    decisions.extend(
        Wait(job.id, i + 1, reason, grow) for i, (job, reason, grow) in enumerate(waiting)
    )
    return decisions


def _grow(
    job: QueuedJob, ask: Vector, state: _State, no_growth: set[tuple[object, ...]]
) -> Grow | None:
    """The nodes to add so that ``job``'s gang fits, with the live nodes' free room, on
    nodes still addable (promised to it: taken from ``state.addable``); None when even
    those are not enough."""
    shape = (job.workers, *ask)
    if not state.addable or shape in no_growth:
        return None
    room = {k: list(v) for k, v in state.free.items()} | state.addable
    placement = _place(job.workers, ask, room)
    if placement is None:
        no_growth.add(shape)  # the addable nodes only shrink during a plan
        return None
    added: dict[str, int] = {}
    for node in set(placement) & state.addable.keys():
        del state.addable[node]
        kind = node.rsplit("#", 1)[0]
        added[kind] = added.get(kind, 0) + 1
    return Grow(tuple(sorted(added.items())), job.bundles())


def _quota_block(job: QueuedJob, tenants: dict[str, TenantQuota], state: _State) -> str | None:
    quota = tenants.get(job.tenant_id, TenantQuota(job.tenant_id))
    u = state.usage.get(job.tenant_id, _Usage())
    if u.jobs >= quota.max_concurrent_jobs:
        return f"tenant is at its quota of {quota.max_concurrent_jobs} concurrent job(s)"
    if u.gpus + job.gpus > quota.max_gpus:
        return f"tenant would pass its quota of {quota.max_gpus:g} GPUs"
    return None


def _place(workers: int, ask: Vector, free: dict[str, Vector]) -> tuple[str, ...] | None:
    """Best-fit every worker of a gang (``workers`` workers, each asking ``ask``) onto
    ``free`` (changed in place only when the whole gang fits); None when some worker has
    nowhere to go."""
    for i, need in enumerate(ask):
        if need and sum(room[i] for room in free.values()) < workers * need - 1e-9:
            return None  # not even the total free capacity holds it
    taken: dict[str, int] = {}  # workers put on each node so far
    nodes: list[str] = []
    others = range(2, len(ask))  # resources past CPU and GPU, rarely any
    for _ in range(workers):
        best: tuple[float, str] | None = None
        for node_id, room in free.items():
            n = taken.get(node_id, 0) + 1
            cpus, gpus = room[0] - n * ask[0], room[1] - n * ask[1]
            if cpus < -1e-9 or gpus < -1e-9 or any(room[i] < n * ask[i] - 1e-9 for i in others):
                continue
            if best is None or (cpus + gpus, node_id) < best:
                best = (cpus + gpus, node_id)
        if best is None:
            return None
        taken[best[1]] = taken.get(best[1], 0) + 1
        nodes.append(best[1])
    for node_id, n in taken.items():
        free[node_id] = [r - n * a for r, a in zip(free[node_id], ask, strict=True)]
    return tuple(nodes)


def _never_fits(job: QueuedJob, snapshot: Snapshot) -> str:
    others = "".join(f", {v:g} {k}" for k, v in sorted(job.resources_per_worker.items()))
    asked = (
        f"the job asks for {job.workers} worker(s) of {job.cpus_per_worker:g} CPU and "
        f"{job.gpus_per_worker:g} GPU{others} each ({job.cpus:g} CPU, {job.gpus:g} GPU in all)"
    )
    kinds = [
        (f"of node type {t.name!r}" + ("" if t.max_count < 0 else f" (at most {t.max_count})"),
         t.cpus, t.gpus, t.resources)
        for t in snapshot.node_types
    ] + [(f"live node {n.id}", n.cpus, n.gpus, n.resources) for n in snapshot.nodes]  # fmt: skip
    if not kinds:
        return f"{asked}; the cluster has no nodes and no node types it can add"
    name, cpus, gpus, resources = max(kinds, key=lambda k: (k[2], k[1]))
    more = "".join(f", {v:g} {k}" for k, v in sorted(resources.items()))
    return (
        f"{asked}; the cluster has {len(snapshot.nodes)} live node(s) and "
        f"{len(snapshot.node_types)} node type(s) it can add, the largest node {name} with "
        f"{cpus:g} CPU and {gpus:g} GPU{more}; lower tunefleet.resources (fewer workers, or "
        "fewer CPUs/GPUs each), or add a node type that holds a worker"
    )


# -- serving: does a replica fit any node? ---------------------------------------------


def replica_never_fits(
    base_model: str,
    weights: float,
    adapter_memory: float,
    nodes: Sequence[Node],
    node_types: Sequence[NodeType],
) -> str | None:
    """Why a serving replica of ``base_model`` (it reserves its ``weights`` plus its
    ``adapter_memory`` budget in Ray's memory resource) could be placed on no node the
    cluster has or can add, or None where one may hold it. Nodes labelled not for replicas
    (the head, the controllers', training-only groups) do not count; a node or node type
    whose memory is not known may hold it. Ray would otherwise keep such a replica
    pending for ever, and its autoscaler could add no node for it."""
    ask = weights + adapter_memory

    def serves(labels: Mapping[str, str]) -> bool:
        return labels.get(NODE_ROLE_LABEL) not in NOT_FOR_REPLICAS

    kinds = [
        (f"node type {t.name!r}", t.memory)
        for t in node_types
        if serves(t.labels) and t.max_count != 0
    ] + [(f"live node {n.id}", n.memory) for n in nodes if serves(n.labels)]
    if any(memory is None or memory >= ask for _, memory in kinds):
        return None
    asked = (
        f"a serving replica of base model {base_model!r} reserves {fmt_bytes(ask)} of Ray "
        f"memory: its weights ({fmt_bytes(weights)}) and its adapter memory "
        f"({fmt_bytes(adapter_memory)}, TUNEFLEET_SERVE_ADAPTER_MEMORY, the chart's "
        "serve.adapterMemory)"
    )
    bigger = (
        "add a node type for serving with more memory (a worker group's memory limit is "
        "its nodes' Ray memory)"
    )
    if not kinds:
        return (
            f"{asked}; no node the cluster has or can add takes serving replicas (those "
            f"labelled {NODE_ROLE_LABEL} in {', '.join(NOT_FOR_REPLICAS)} do not): {bigger}"
        )
    name, memory = max(kinds, key=lambda k: k[1] or 0.0)
    largest = memory or 0.0
    fix = (
        f"lower the adapter memory to at most {fmt_bytes(largest - weights)}, or {bigger}"
        if largest > weights
        else f"the weights alone do not fit: {bigger}, or serve a smaller model"
    )
    return f"{asked}; the largest node that serves, {name}, has {fmt_bytes(largest)}: {fix}"


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
