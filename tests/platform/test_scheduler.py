"""The scheduling policy alone: no database, no Ray, no clock (``now`` is an argument)."""

from __future__ import annotations

from dataclasses import replace

from tunefleet.platform.scheduler import (
    Dispatch,
    Node,
    QueuedJob,
    Reject,
    RunningJob,
    Snapshot,
    TenantQuota,
    Wait,
    plan,
)

S = 1_000_000_000  # ns per second


def q(id: str, tenant: str, t: float, **kw: object) -> QueuedJob:
    return QueuedJob(id=id, tenant_id=tenant, created_ns=int(t * S), **kw)  # type: ignore[arg-type]


def by_kind(decisions: list, kind: type) -> list:  # type: ignore[type-arg]
    return [d for d in decisions if isinstance(d, kind)]


def simulate(
    jobs: list[QueuedJob],
    nodes: list[Node],
    tenants: dict[str, TenantQuota],
    *,
    duration: dict[str, float] | None = None,
    arrivals: dict[float, list[QueuedJob]] | None = None,
    steps: int = 200,
    starvation_s: float = 600.0,
) -> list[tuple[float, str]]:
    """A discrete-time cluster: each second, finish due jobs, plan, start what plan says.
    Returns (start time, job id) in start order."""
    queued = list(jobs)
    running: dict[str, tuple[QueuedJob, tuple[str, ...], float]] = {}
    started: list[tuple[float, str]] = []
    for now in range(steps):
        for t, new in (arrivals or {}).items():
            if t == now:
                queued.extend(new)
        for job_id, (_, _, end) in list(running.items()):
            if end <= now:
                del running[job_id]
        free = {n.id: [n.cpus, n.gpus] for n in nodes}
        for job, placed, _ in running.values():
            for node_id in placed:
                free[node_id][0] -= job.cpus_per_worker
                free[node_id][1] -= job.gpus_per_worker
        snap = Snapshot(
            queued=queued,
            running=[RunningJob(j.id, j.tenant_id, j.cpus, j.gpus) for j, _, _ in running.values()],
            tenants=tenants,
            nodes=[replace(n, free_cpus=free[n.id][0], free_gpus=free[n.id][1]) for n in nodes],
            starvation_s=starvation_s,
        )
        for d in by_kind(plan(snap, float(now)), Dispatch):
            job = next(j for j in queued if j.id == d.job_id)
            queued.remove(job)
            running[job.id] = (job, d.nodes, now + (duration or {}).get(job.id, 3))
            started.append((float(now), job.id))
        if not queued and not running and not any(t > now for t in (arrivals or {})):
            break
    return started


def test_fair_share_interleaves_tenants_regardless_of_who_queued_first() -> None:
    # tenant a queues ten jobs, then b two; two slots
    jobs = [q(f"a{i}", "a", i * 0.001) for i in range(10)] + [q("b0", "b", 1), q("b1", "b", 1.1)]
    quotas = {"a": TenantQuota("a"), "b": TenantQuota("b")}
    order = [j for _, j in simulate(jobs, [Node("n1", cpus=2)], quotas)]
    assert order[:4] == ["a0", "b0", "a1", "b1"]
    assert sorted(order) == sorted(j.id for j in jobs)  # everyone ran


def test_shares_are_weighted_by_quota() -> None:
    jobs = [q(f"a{i}", "a", i) for i in range(20)] + [q(f"b{i}", "b", i) for i in range(20)]
    quotas = {"a": TenantQuota("a", max_concurrent_jobs=3), "b": TenantQuota("b", 1)}
    snap = Snapshot(jobs, [], quotas, [Node("n1", cpus=4)])
    started = [d.job_id[0] for d in by_kind(plan(snap, 100.0), Dispatch)]
    assert sorted(started) == ["a", "a", "a", "b"]


def test_quotas_hold_a_tenant_back_without_blocking_others() -> None:
    jobs = [q("a0", "a", 0), q("a1", "a", 1), q("g0", "g", 2, gpus_per_worker=2), q("b0", "b", 3)]
    quotas = {
        "a": TenantQuota("a", max_concurrent_jobs=1),
        "g": TenantQuota("g", max_gpus=1),
        "b": TenantQuota("b"),
    }
    snap = Snapshot(jobs, [RunningJob("a-old", "a", 1)], quotas, [Node("n", cpus=8, gpus=4)])
    decisions = plan(snap, 10.0)
    assert {d.job_id for d in by_kind(decisions, Dispatch)} == {"b0"}
    reasons = {d.job_id: d.reason for d in by_kind(decisions, Wait)}
    assert "quota of 1 concurrent" in reasons["a0"] and "quota of 1 concurrent" in reasons["a1"]
    assert "quota of 1 GPUs" in reasons["g0"]


def test_higher_priority_first_and_lower_classes_wait_behind_it() -> None:
    jobs = [
        q("low-old", "a", 0),
        q("high-new", "b", 5, priority=10, workers=2),
        q("low-small", "c", 6),
    ]
    quotas = {t: TenantQuota(t) for t in "abc"}
    # one CPU free: the high-priority gang (2 CPUs) cannot start; nothing lower may
    snap = Snapshot(jobs, [], quotas, [Node("n", cpus=2, free_cpus=1)])
    decisions = plan(snap, 10.0)
    assert by_kind(decisions, Dispatch) == []
    waits = by_kind(decisions, Wait)
    assert [w.job_id for w in waits] == ["high-new", "low-old", "low-small"]
    assert [w.position for w in waits] == [1, 2, 3]
    assert "higher priority" in waits[1].reason
    # with room, it starts first
    roomy = replace(snap, nodes=[Node("n", cpus=3)])
    assert [d.job_id for d in by_kind(plan(roomy, 10.0), Dispatch)] == ["high-new", "low-old"]


def test_gang_placement_is_all_workers_or_none() -> None:
    gang = q("gang", "a", 0, workers=3, cpus_per_worker=2)
    nodes = [Node("n1", cpus=4, free_cpus=2), Node("n2", cpus=4, free_cpus=2)]
    decisions = plan(Snapshot([gang], [], {"a": TenantQuota("a")}, nodes), 1.0)
    assert isinstance(decisions[0], Wait) and "3 worker(s)" in decisions[0].reason
    nodes = [*nodes, Node("n3", cpus=4, free_cpus=3)]
    (d,) = plan(Snapshot([gang], [], {"a": TenantQuota("a")}, nodes), 1.0)
    assert isinstance(d, Dispatch) and sorted(d.nodes) == ["n1", "n2", "n3"]


def test_best_fit_keeps_the_large_gap_for_a_large_job() -> None:
    small, big = q("small", "a", 0), q("big", "b", 1, cpus_per_worker=4)
    nodes = [Node("roomy", cpus=4), Node("snug", cpus=1)]
    quotas = {"a": TenantQuota("a"), "b": TenantQuota("b")}
    decisions = plan(Snapshot([small, big], [], quotas, nodes), 2.0)
    assert by_kind(decisions, Dispatch) == [
        Dispatch("small", ("snug",)),
        Dispatch("big", ("roomy",)),
    ]


def test_backfill_starts_small_jobs_in_the_gap_until_the_big_one_starves() -> None:
    big = q("big", "b", 0, workers=2, cpus_per_worker=2)
    smalls = [q(f"s{i}", "a", 0.5 + i) for i in range(3)]
    quotas = {"a": TenantQuota("a"), "b": TenantQuota("b")}
    node = Node("n", cpus=4, free_cpus=2)  # 2 CPUs held by someone else's run
    snap = Snapshot([big, *smalls], [RunningJob("x", "c", 2)], quotas, [node], starvation_s=60)
    early = plan(snap, 30.0)
    assert [d.job_id for d in by_kind(early, Dispatch)] == ["s0", "s1"]  # backfilled
    late = plan(snap, 61.0)  # big has waited 61 s: it reserves, nothing behind it starts
    assert by_kind(late, Dispatch) == []
    assert all("reserved for big" in w.reason for w in by_kind(late, Wait) if w.job_id != "big")


def test_no_starvation_under_a_steady_stream_of_small_jobs() -> None:
    big = q("big", "b", 0, workers=2)
    stream = {t: [q(f"s{t}", "a", t)] for t in range(1, 150)}
    quotas = {"a": TenantQuota("a", max_concurrent_jobs=8), "b": TenantQuota("b")}
    started = simulate(
        [q("s0", "a", 0), big], [Node("n", cpus=2)], quotas, arrivals=stream, starvation_s=20
    )
    start_of = {j: t for t, j in started}
    assert "big" in start_of and start_of["big"] <= 20 + 3  # reserved once starving


def test_impossible_requests_are_rejected_with_what_the_cluster_has() -> None:
    job = q("huge", "a", 0, workers=2, gpus_per_worker=4)
    (d,) = plan(Snapshot([job], [], {}, [Node("n", cpus=16, gpus=2)]), 0.0)
    assert isinstance(d, Reject)
    assert "2 worker(s)" in d.reason and "largest with 16 CPU and 2 GPU" in d.reason


def test_retry_backoff_waits_until_not_before() -> None:
    job = q("r", "a", 0, not_before=100.0)
    (d,) = plan(Snapshot([job], [], {}, [Node("n", cpus=1)]), 40.0)
    assert isinstance(d, Wait) and "in 60s" in d.reason
    (d,) = plan(Snapshot([job], [], {}, [Node("n", cpus=1)]), 100.0)
    assert isinstance(d, Dispatch)


def test_planning_is_fast_for_a_thousand_jobs() -> None:
    jobs = [q(f"j{i}", f"t{i % 20}", i, priority=i % 3) for i in range(1000)]
    quotas = {f"t{i}": TenantQuota(f"t{i}") for i in range(20)}
    decisions = plan(Snapshot(jobs, [], quotas, [Node(f"n{i}", cpus=8) for i in range(4)]), 2000.0)
    assert len(decisions) == 1000
    assert len(by_kind(decisions, Dispatch)) == 32
    waits = by_kind(decisions, Wait)
    assert [w.position for w in waits] == list(range(1, len(waits) + 1))
