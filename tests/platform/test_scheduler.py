"""The scheduling policy alone: no database, no Ray, no clock (``now`` is an argument)."""

from __future__ import annotations

from dataclasses import replace

from tunefleet.platform.scheduler import (
    Dispatch,
    Grow,
    Node,
    NodeType,
    QueuedJob,
    Reject,
    RunningJob,
    Snapshot,
    TenantQuota,
    Wait,
    plan,
    replica_never_fits,
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
    assert (
        "2 worker(s)" in d.reason and "largest node live node n with 16 CPU and 2 GPU" in d.reason
    )


def test_a_job_no_live_node_holds_waits_for_the_nodes_its_node_type_can_add() -> None:
    """A GPU job on a cluster whose GPU group is at zero: it waits for the autoscaler,
    naming the group and the count, with its gang's bundles to ask for; the group's
    ``max_count`` less its live nodes is what can still come."""
    head = Node("head", cpus=2)
    gpu = NodeType("gpu-a100", cpus=8, gpus=1, resources={"a100": 1}, max_count=3)
    job = q("g", "a", 0, workers=2, cpus_per_worker=4, gpus_per_worker=1)
    (d,) = plan(Snapshot([job], [], {}, [head], node_types=[gpu]), 1.0)
    assert isinstance(d, Wait)
    assert d.reason == "waiting for the autoscaler to add 2 node(s) of group gpu-a100"
    assert d.grow == Grow((("gpu-a100", 2),), ({"CPU": 4, "GPU": 1},) * 2)
    # two of three are up and busy: one more can come, the gang needs two; it waits for
    # room on the nodes there are, asking for none
    up = replace(gpu, live=2)
    busy = [Node(f"gpu-{i}", 8, 1, 0, 0, {"a100": 1}, {"a100": 0}) for i in (1, 2)]
    (d,) = plan(Snapshot([job], [], {}, [head, *busy], node_types=[up]), 1.0)
    assert isinstance(d, Wait) and d.grow is None and "to be free at once" in d.reason
    # a gang larger than the group at its most (and the live nodes besides: they may be
    # the group's, counted twice) is rejected, naming it
    six = replace(job, workers=6)
    (d,) = plan(Snapshot([six], [], {}, [head, *busy], node_types=[up]), 1.0)
    assert isinstance(d, Reject) and "of node type 'gpu-a100' (at most 3)" in d.reason
    # a live node with room: the job starts there, nothing is asked
    live = Node("gpu-1", cpus=8, gpus=1, resources={"a100": 1})
    one = q("one", "a", 0, cpus_per_worker=4, gpus_per_worker=1)
    (d,) = plan(Snapshot([one], [], {}, [head, live], node_types=[gpu]), 1.0)
    assert d == Dispatch("one", ("gpu-1",))


def test_a_node_counted_up_before_it_is_seen_live_never_gets_a_job_rejected() -> None:
    """The live nodes and the node types' live counts are read one after the other: a node
    that joins in between is counted up but not yet seen. The job waits (and is placed on
    the next pass), it is not failed as too big."""
    gpu = NodeType("gpu", cpus=8, gpus=1, max_count=1, live=1)
    job = q("g", "a", 0, cpus_per_worker=4, gpus_per_worker=1)
    (d,) = plan(Snapshot([job], [], {}, [Node("head", cpus=2)], node_types=[gpu]), 1.0)
    assert isinstance(d, Wait) and d.grow is None


def test_nodes_promised_to_one_waiting_job_are_not_counted_again_for_the_next() -> None:
    gpu = NodeType("gpu", cpus=8, gpus=1, max_count=2)
    jobs = [q(f"j{i}", f"t{i}", i, workers=2, cpus_per_worker=1, gpus_per_worker=1) for i in (0, 1)]
    first, second = plan(Snapshot(jobs, [], {}, [Node("head", cpus=2)], node_types=[gpu]), 5.0)
    assert isinstance(first, Wait) and first.grow is not None
    assert first.grow.nodes == (("gpu", 2),)
    assert isinstance(second, Wait) and second.grow is None
    assert "to be free at once" in second.reason


def test_a_job_asking_for_a_resource_goes_only_where_a_node_has_it() -> None:
    plain = Node("plain", cpus=8)
    special = Node(
        "special", cpus=2, resources={"accelerator": 1}, free_resources={"accelerator": 1}
    )
    job = q("x", "a", 0, resources_per_worker={"accelerator": 1})
    (d,) = plan(Snapshot([job], [], {}, [plain, special]), 1.0)
    assert d == Dispatch("x", ("special",))
    busy = replace(special, free_resources={"accelerator": 0})
    (d,) = plan(Snapshot([job], [], {}, [plain, busy]), 1.0)
    assert isinstance(d, Wait) and d.grow is None
    # nobody has two of it, and no node type adds one: never
    two = q("two", "a", 0, resources_per_worker={"accelerator": 2})
    (d,) = plan(Snapshot([two], [], {}, [plain, special]), 1.0)
    assert isinstance(d, Reject) and "2 accelerator each" in d.reason
    (d,) = plan(
        Snapshot([two], [], {}, [plain], node_types=[NodeType("big", 4, 0, {"accelerator": 4})]),
        1.0,
    )
    assert (
        isinstance(d, Wait)
        and d.grow is not None
        and d.grow.bundles == ({"CPU": 1, "accelerator": 2},)
    )


def test_without_nodes_or_node_types_a_job_is_rejected_saying_so() -> None:
    (d,) = plan(Snapshot([q("x", "a", 0)], [], {}, []), 1.0)
    assert isinstance(d, Reject) and "no nodes and no node types" in d.reason


def test_retry_backoff_waits_until_not_before() -> None:
    job = q("r", "a", 0, not_before=100.0)
    (d,) = plan(Snapshot([job], [], {}, [Node("n", cpus=1)]), 40.0)
    assert isinstance(d, Wait) and "in 60s" in d.reason
    (d,) = plan(Snapshot([job], [], {}, [Node("n", cpus=1)]), 100.0)
    assert isinstance(d, Dispatch)


def test_a_thousand_jobs_of_twenty_tenants_on_32_nodes_keep_every_rule() -> None:
    """At scale every rule still holds, checked against the decisions alone (no timing:
    bench/controller.py measures planning): one decision per job, gangs within their
    nodes' free room, tenants within quota, every tenant started, every wait true."""
    tenants = [f"t{i:02d}" for i in range(20)]
    quotas = {
        t: TenantQuota(t, max_concurrent_jobs=2 + i % 6 * 2, max_gpus=float(i % 5) * 2)
        for i, t in enumerate(tenants)
    }
    nodes = [
        Node(f"n{i:02d}", cpus=16, gpus=4 if i % 2 else 0, free_cpus=16 - i % 4) for i in range(32)
    ]
    shapes = [  # (workers, CPUs per worker, GPUs per worker)
        (1, 1, 0),
        (2, 2, 0),
        (4, 4, 0),
        (1, 2, 1),
        (2, 4, 2),
        (4, 8, 0),
        (3, 1, 5),  # needs more GPUs than any node has: rejected
    ]
    jobs = [
        q(
            f"j{i:04d}",
            tenants[(i * 7) % 20],
            i,
            priority=i % 3,
            workers=shapes[i % 7][0],
            cpus_per_worker=shapes[i % 7][1],
            gpus_per_worker=shapes[i % 7][2],
            not_before=3000.0 if i % 50 == 0 else None,
        )
        for i in range(1000)
    ]
    running = [RunningJob(f"r{i}", tenants[i], cpus=2, gpus=i % 2) for i in (4, 9, 10, 17)]
    now, starving = 1000.0, 900.0  # jobs queued in the first 100 s may reserve room
    decisions = plan(Snapshot(jobs, running, quotas, nodes, starvation_s=starving), now)

    job_of = {j.id: j for j in jobs}
    assert sorted(d.job_id for d in decisions) == sorted(job_of)  # one decision per job
    dispatches, waits = by_kind(decisions, Dispatch), by_kind(decisions, Wait)
    rejected = {d.job_id for d in by_kind(decisions, Reject)}
    assert rejected == {j.id for j in jobs if j.gpus_per_worker > 4}
    assert [w.position for w in waits] == list(range(1, len(waits) + 1))
    backoff = {j.id for j in jobs if j.not_before is not None} - rejected
    assert {w.job_id for w in waits if "retrying after a failed run" in w.reason} == backoff

    # gangs: every worker placed, on room that was free
    free = {n.id: list(n.free) for n in nodes}
    for d in dispatches:
        job = job_of[d.job_id]
        assert len(d.nodes) == job.workers
        for node_id in d.nodes:
            free[node_id][0] -= job.cpus_per_worker
            free[node_id][1] -= job.gpus_per_worker
    assert all(cpus >= 0 and gpus >= 0 for cpus, gpus in free.values()), free

    # quotas: running plus started stays within each tenant's
    jobs_of = {t: sum(r.tenant_id == t for r in running) for t in tenants}
    gpus_of = {t: sum(r.gpus for r in running if r.tenant_id == t) for t in tenants}
    for d in dispatches:
        job = job_of[d.job_id]
        jobs_of[job.tenant_id] += 1
        gpus_of[job.tenant_id] += job.gpus
    for t in tenants:
        assert jobs_of[t] <= quotas[t].max_concurrent_jobs and gpus_of[t] <= quotas[t].max_gpus
    # fair share: each tenant with nothing running starts a job before any starts a second
    idle = set(tenants) - {r.tenant_id for r in running}
    assert {job_of[d.job_id].tenant_id for d in dispatches[: len(idle)]} == idle
    assert {job_of[d.job_id].tenant_id for d in dispatches} == set(tenants)  # all started

    # every wait is true of the final state (room and quota only shrink during a plan)
    def fits_now(job: QueuedJob) -> bool:
        per_node = (
            min(cpus // job.cpus_per_worker, (gpus // job.gpus_per_worker) if job.gpus else 1e9)
            for cpus, gpus in free.values()
        )
        return sum(per_node) >= job.workers

    short_of_room = {w.job_id for w in waits if "to be free at once" in w.reason}
    reasons: set[str] = set()
    for w in waits:
        job = job_of[w.job_id]
        if "concurrent job(s)" in w.reason:
            assert jobs_of[job.tenant_id] == quotas[job.tenant_id].max_concurrent_jobs
            reasons.add("job quota")
        elif "GPUs" in w.reason and "quota" in w.reason:
            assert gpus_of[job.tenant_id] + job.gpus > quotas[job.tenant_id].max_gpus
            reasons.add("GPU quota")
        elif "to be free at once" in w.reason:
            assert not fits_now(job), w
            reasons.add("capacity")
        elif "reserved for" in w.reason:
            holder = job_of[w.reason.split("reserved for ")[1].split(",")[0]]
            assert holder.id in short_of_room and holder.priority == job.priority
            assert now - holder.created_ns / S >= starving
            reasons.add("reservation")
        elif "higher priority" in w.reason:
            assert any(job_of[j].priority > job.priority for j in short_of_room)
            reasons.add("higher class")
        else:
            assert w.job_id in backoff, w
    assert len(reasons) == 5 and len(dispatches) > 20  # the scenario exercises every rule
    # a job that waits for room stops every lower priority class
    lowest = max(job_of[j].priority for j in short_of_room)
    assert all(job_of[d.job_id].priority >= lowest for d in dispatches)


def test_after_a_failure_the_retry_backs_off_then_the_job_fails() -> None:
    from tunefleet.platform.scheduler import MAX_RUN_FAILURES, Retry, after_failure

    assert [after_failure(n) for n in range(MAX_RUN_FAILURES)] == [
        Retry(1, 10),
        Retry(2, 20),
        None,
    ]
    assert after_failure(0, "disk_full") is None  # the next run would find the same disk
    assert after_failure(0, "training_failed") == Retry(1, 10)


def test_ia3_is_served_merged_every_other_method_batched() -> None:
    from tunefleet.platform.scheduler import serving_mode

    assert serving_mode("ia3") == "merged"
    assert {serving_mode(m) for m in ("lora", "qlora", "dora", "full")} == {"multiplexed"}


GiB = 1 << 30
TRAINING = {"tunefleet.io/role": "training"}


def test_a_serving_replica_is_refused_only_where_no_node_it_may_use_holds_it() -> None:
    """A replica reserves its weights plus its adapter memory: it fits where one node
    that takes replicas (live, or of a type the autoscaler can still add) has that much
    Ray memory, or where a node's memory is not known; the head and training-only groups
    do not count, nor a type that may hold no node."""
    live = Node("n1", cpus=4, memory=16 * GiB)
    assert replica_never_fits("m", 2 * GiB, 4 * GiB, [live], []) is None
    assert replica_never_fits("m", 2 * GiB, 14 * GiB, [live], []) is None  # exactly full
    big = NodeType("big", cpus=8, memory=64 * GiB)
    assert replica_never_fits("m", 2 * GiB, 40 * GiB, [live], [big]) is None  # can be added
    assert replica_never_fits("m", 2 * GiB, 40 * GiB, [live], [NodeType("x", 8)]) is None

    head = Node("head", cpus=0, memory=512 * GiB, labels={"tunefleet.io/role": "head"})
    gpu = NodeType("a100", cpus=8, gpus=1, memory=512 * GiB, labels=TRAINING)
    none_left = replace(big, max_count=0)
    why = replica_never_fits("m", 2 * GiB, 40 * GiB, [live, head], [gpu, none_left])
    assert why is not None
    assert "base model 'm' reserves 42.00 GiB of Ray memory" in why
    assert "weights (2.00 GiB)" in why and "adapter memory (40.00 GiB" in why
    assert "serve.adapterMemory" in why
    assert "the largest node that serves, live node n1, has 16.00 GiB" in why
    assert "lower the adapter memory to at most 14.00 GiB" in why
    assert "add a node type for serving with more memory" in why

    weights_alone = replica_never_fits("m", 20 * GiB, 1 * GiB, [live], [])
    assert weights_alone is not None and "the weights alone do not fit" in weights_alone
    assert "lower the adapter memory" not in weights_alone

    nowhere = replica_never_fits("m", 1 * GiB, 1 * GiB, [head], [gpu])
    assert nowhere is not None and "no node the cluster has or can add" in nowhere
