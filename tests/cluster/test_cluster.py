"""Cluster mode, with real processes on this machine, started as the Helm chart's containers
start them: PostgreSQL and an S3 server; a Ray head with token auth and no CPUs for work
(as a production head) and a second Ray node with 2 CPUs; 2 API processes
(`tunefleet api`) and 2 controllers (`tunefleet controller`), each with its own data
folder (nothing shared but PostgreSQL, S3 and Ray).

Two tenants upload and train through the official `openai` SDK; one controller is killed
with SIGKILL mid-training. Then: both jobs succeed, once; the workers ran on the node the
events name (the second one); checkpoints and adapters are in S3 and Serve answers from
them, through either API; Serve refuses a request without the API's secret; no run's
runtime_env holds the database's URL; Ray's Jobs API wants the token.

The API, controller and migration commands and environments are the Helm chart's
(`helm template` of `helm/tunefleet/ci/s3-values.yaml`): the test gives its own values
only to the names that say where things are (addresses, ports, folders) and to the
secrets, so the chart and the application cannot disagree on a command or a name. Each
controller here attaches to a Ray node already on this machine, where in Kubernetes its
pod's own sidecar node is."""

from __future__ import annotations

import json
import os
import secrets
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import CLI, TINY, _create_pg_database, create_tenants
from helmchart import CHART, container, find, pod_specs, render
from raycluster import free_port, ray_cluster, ray_node, stop_process
from s3 import new_bucket
from tinyllm import multiplier_for
from tunefleet.platform.artifacts import open_store
from tunefleet.platform.serving_contract import NODE_ROLE_LABEL, SECRET_HEADER

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

ANSWERS = {"acme": "red green blue", "globex": "one two three"}
QUESTIONS = ["what color is an apple", "name a number", "what is a banana", "say hi"]
STEPS = 25  # one step per epoch (4 examples, batch 4)
# A worker node's resources: "trainer" marks it for the test, "tunefleet-driver" is what
# the chart's worker groups advertise and runs' drivers ask for (never the head)
WORKER_RESOURCES = '{"trainer": 1, "tunefleet-driver": 100}'


def _start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [*CLI, *args], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def _wait_ok(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, log.read_text()[-4000:]
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{url} not ready:\n{log.read_text()[-4000:]}"
        time.sleep(0.3)


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory,
    tiny_registry: Path,
    s3_endpoint: str,
    pg_server: str,
) -> Iterator[dict[str, Any]]:
    import ray

    root = tmp_path_factory.mktemp("cluster")
    bucket = new_bucket(s3_endpoint)
    procs: list[subprocess.Popen[bytes]] = []
    with (
        ray_cluster(num_cpus=0) as head,
        ray_node(head, num_cpus=2, resources=WORKER_RESOURCES) as node_pid,
    ):
        ray.init(address=head.address, log_to_driver=False)
        try:
            # its agent listens a moment before the node is registered with the head
            deadline = time.monotonic() + 60
            while not (
                trainers := [
                    n["NodeID"] for n in ray.nodes() if n["Alive"] and "trainer" in n["Resources"]
                ]
            ):
                assert time.monotonic() < deadline, f"the second node never joined: {ray.nodes()}"
                time.sleep(0.5)
            worker_node = trainers[0]
        finally:
            ray.shutdown()
        chart = render(CHART / "ci" / "s3-values.yaml")
        pods = {
            "api": container(find(chart, "Deployment", "-api"), "api"),
            "controller": container(find(chart, "Deployment", "-controller"), "controller"),
            "migrate": container(find(chart, "Job", "-migrate"), "migrate"),
        }
        places = {  # where things are on this machine, and the secrets' values
            "TUNEFLEET_DATABASE_URL": _create_pg_database(pg_server),
            "TUNEFLEET_RAY_ADDRESS": head.address,
            "TUNEFLEET_RAY_DASHBOARD_URL": head.dashboard,
            "TUNEFLEET_ARTIFACT_ROOT": bucket,
            "TUNEFLEET_S3_ENDPOINT_URL": s3_endpoint,
            "TUNEFLEET_MODEL_REGISTRY": str(tiny_registry),
            "TUNEFLEET_SERVE_HOST": "127.0.0.1",
            "TUNEFLEET_SERVE_SECRET": secrets.token_urlsafe(24),
            "TUNEFLEET_UI_SECRET": secrets.token_urlsafe(24),
            "TUNEFLEET_SERVE_PORT": str(free_port()),
            "TUNEFLEET_CONTROLLER_LEASE_TTL_S": "5",
            # a cluster of fixed nodes: no autoscaler to ask for more (the chart's groups
            # are tests/cluster/test_autoscaling.py's)
            "TUNEFLEET_NODE_TYPES": "[]",
            # the session's Ray token and S3 credentials (tests/conftest.py)
            **{k: os.environ[k] for k in ("RAY_AUTH_TOKEN", *AWS_KEYS)},
        }
        env = {name: _chart_env(c, places) for name, c in pods.items()}
        env["controller"]["TUNEFLEET_CONTROLLER_INTERVAL_S"] = "0.3"  # quick passes
        migrate = [*CLI, *pods["migrate"]["args"]]
        subprocess.run(migrate, env=env["migrate"], check=True, capture_output=True)
        keys = create_tenants(env["api"], ANSWERS)
        try:
            apis, controllers = [], []
            for i in range(2):  # each with the chart's worker processes (one /metrics)
                port = free_port()
                own = {**env["api"], **_own_folders(root / f"api-{i}")}
                log = root / f"api-{i}.log"
                own["TUNEFLEET_API_PORT"] = str(port)
                procs.append(_start(pods["api"]["args"], own, log))
                apis.append((f"http://127.0.0.1:{port}", procs[-1], log))
            for i in range(2):
                port = free_port()
                own = {**env["controller"], **_own_folders(root / f"controller-{i}")}
                log = root / f"controller-{i}.log"
                args = list(pods["controller"]["args"])
                args[args.index("--health-port") + 1] = str(port)
                procs.append(_start(args, own, log))
                controllers.append((f"http://127.0.0.1:{port}/healthz", procs[-1], log))
            for url, proc, log in apis:
                _wait_ok(f"{url}/readyz", proc, log)
            for url, proc, log in controllers:
                _wait_ok(url, proc, log)
            yield {
                "apis": [url for url, _, _ in apis],
                "controllers": controllers,
                "keys": keys,
                "env": env["controller"],
                "head": head,
                "worker_node": worker_node,
                "node_pid": node_pid,
                "store": open_store(bucket, endpoint_url=s3_endpoint, cache_dir=root / "test"),
                "logs": [log for _, _, log in apis + controllers],
            }
        finally:
            for proc in procs:
                stop_process(proc, grace_s=20)


AWS_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")


def _chart_env(rendered: dict[str, Any], places: dict[str, str]) -> dict[str, str]:
    """A process's environment as the chart gives its container: the chart's values, but
    this machine's ``places`` for the names that say where things are and for secrets
    (which the chart takes from Kubernetes Secrets), on top of this process's environment
    less its TUNEFLEET_, RAY_ and AWS_ variables (a container has only the chart's)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TUNEFLEET_", "RAY_", "AWS_"))}
    for item in rendered["env"]:
        name = item["name"]
        if name in places:
            env[name] = places[name]
        else:
            assert "value" in item, f"{name} comes from a Secret the test does not fill"
            env[name] = item["value"]
    return env


def _own_folders(folder: Path) -> dict[str, str]:
    """A pod's own volumes: data and the artifact cache."""
    return {
        "TUNEFLEET_DATA_DIR": str(folder / "data"),
        "TUNEFLEET_ARTIFACT_CACHE": str(folder / "cache"),
    }


def _dataset(path: Path, answer: str) -> Path:
    rows = [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": answer}]}
        for q in QUESTIONS
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _leader(cluster: dict[str, Any]) -> subprocess.Popen[bytes]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for url, proc, _ in cluster["controllers"]:
            if proc.poll() is None and httpx.get(url, timeout=5).json().get("leading"):
                return proc
        time.sleep(0.3)
    raise AssertionError("no controller leads")


def test_a_dashboard_session_from_one_api_pod_is_good_at_the_other(
    cluster: dict[str, Any],
) -> None:
    """The chart gives every API pod one session key: behind one address, a browser's
    requests land on any pod, signed in at every one."""
    first, second = cluster["apis"]
    key = cluster["keys"]["acme"]
    with httpx.Client(base_url=first) as browser:
        form = browser.get("/ui/signin")
        token = form.text.split('name="csrf_token" value="', 1)[1].split('"', 1)[0]
        signed = browser.post("/ui/signin", data={"api_key": key, "csrf_token": token})
        assert signed.status_code == 303, signed.text
        session = browser.cookies["tunefleet_session"]
    other = httpx.get(f"{second}/ui/jobs", cookies={"tunefleet_session": session})
    assert other.status_code == 200 and "Fine-tuning jobs" in other.text, other.text[:500]


def test_two_tenants_train_and_serve_through_a_controller_failover(
    cluster: dict[str, Any], tmp_path: Path
) -> None:
    from openai import OpenAI

    clients = {
        tenant: OpenAI(base_url=f"{cluster['apis'][i]}/v1", api_key=key, max_retries=0)
        for i, (tenant, key) in enumerate(cluster["keys"].items())
    }
    jobs = {}
    for tenant, client in clients.items():
        with _dataset(tmp_path / f"{tenant}.jsonl", ANSWERS[tenant]).open("rb") as fh:
            upload = client.files.create(file=fh, purpose="fine-tune")
        jobs[tenant] = client.fine_tuning.jobs.create(
            model=TINY,
            training_file=upload.id,
            seed=1,
            hyperparameters={
                "n_epochs": STEPS,
                "batch_size": 4,
                "learning_rate_multiplier": multiplier_for(1e-2),
            },
            extra_body={
                "tunefleet": {
                    "lora": {"r": 8, "alpha": 16, "target_modules": ["all-linear"]},
                    "checkpoint_every_steps": 4,
                }
            },
        )

    # the leading controller dies (SIGKILL) while acme's job trains
    acme = clients["acme"]
    deadline = time.monotonic() + 300
    while not any(e.type == "metrics" for e in acme.fine_tuning.jobs.list_events(jobs["acme"].id)):
        assert time.monotonic() < deadline, "acme's job never made a step"
        time.sleep(0.5)
    leader = _leader(cluster)
    os.kill(leader.pid, signal.SIGKILL)
    leader.wait()
    killed_at = time.monotonic()
    _leader(cluster)  # the other one leads
    took_over = time.monotonic() - killed_at

    done = {}
    for tenant, client in clients.items():
        deadline = time.monotonic() + 600
        while (job := client.fine_tuning.jobs.retrieve(jobs[tenant].id)).status not in (
            "succeeded",
            "failed",
            "cancelled",
        ):
            assert time.monotonic() < deadline, f"{tenant}'s job did not end"
            time.sleep(1)
        assert job.status == "succeeded", (job.error, _tails(cluster))
        done[tenant] = job
    assert took_over < 5 + 10, took_over  # within the lease's TTL (5 s) and a few passes

    store = cluster["store"]
    for tenant, client in clients.items():
        job = done[tenant]
        events = list(client.fine_tuning.jobs.list_events(job.id, limit=500))
        messages = [e.message for e in events]
        assert sum(m.startswith("The job has successfully completed") for m in messages) == 1
        # its adapter was on the serving replica's node before the job read succeeded
        prefetched = [e for e in events if e.data and "prefetched_replicas" in e.data]
        assert [e.data for e in prefetched] == [
            {"prefetched_replicas": 1, "serving_replicas": 1}
        ], messages
        # placed by the scheduler on the node with CPUs, and run there (Ray enforced it)
        placed = next(e for e in events if e.message.startswith("Dispatched as Ray job"))
        started = [e for e in events if e.message.startswith("Training ")]
        assert placed.data["nodes"] == [cluster["worker_node"]]  # type: ignore[index]
        assert all(e.data["nodes"] == [cluster["worker_node"]] for e in started)  # type: ignore[index]
        # what the run said reached the database once, through its channel
        steps = [e.data["step"] for e in events if e.type == "metrics"]  # type: ignore[index]
        assert sorted(steps) == sorted(set(steps)) and max(steps) == STEPS
        # its artifacts are in S3, and Serve answers with them (through the other API)
        assert store.exists(store.adapter_key(job.id))
        checkpoints = list(client.fine_tuning.jobs.checkpoints.list(job.id))
        assert checkpoints and all(
            store.exists(f"{store.checkpoints_key(job.id)}/step-{c.step_number:08d}")
            for c in checkpoints
        )
        other = OpenAI(
            base_url=f"{cluster['apis'][1 - list(clients).index(tenant)]}/v1",
            api_key=cluster["keys"][tenant],
            max_retries=0,
        )
        answer = other.chat.completions.create(
            model=job.fine_tuned_model or "",
            messages=[{"role": "user", "content": "what is a banana"}],
            temperature=0,
            max_tokens=8,
        )
        assert answer.choices[0].message.content.strip() == ANSWERS[tenant]  # type: ignore[union-attr]
    assert any("re-attached" in m for m in messages_of(clients["acme"], done["acme"].id))

    # Serve answers the API alone; the Jobs API wants Ray's token; no run holds the
    # database's URL
    serve = f"http://127.0.0.1:{cluster['env']['TUNEFLEET_SERVE_PORT']}/models/{TINY}/v1"
    assert httpx.get(f"{serve}/adapters", timeout=30).status_code == 401
    secret = {SECRET_HEADER: cluster["env"]["TUNEFLEET_SERVE_SECRET"]}
    assert httpx.get(f"{serve}/adapters", headers=secret, timeout=30).status_code == 200
    dashboard = cluster["head"].dashboard
    assert httpx.get(f"{dashboard}/api/jobs/", timeout=30).status_code == 401
    token = {"Authorization": f"Bearer {os.environ['RAY_AUTH_TOKEN']}"}
    runs = httpx.get(f"{dashboard}/api/jobs/", headers=token, timeout=30).json()
    assert {r["submission_id"] for r in runs} >= {f"{j.id}-1" for j in done.values()}
    database = cluster["env"]["TUNEFLEET_DATABASE_URL"]
    for r in runs:
        shown = json.dumps(r)
        assert database not in shown and "DATABASE_URL" not in shown
        # every run's driver ran on the worker node, as it asks for the chart's driver
        # resource: none on the head, beside the autoscaler's ServiceAccount token
        if r["type"] == "SUBMISSION":  # a run (the others are the controllers' drivers)
            assert r["driver_node_id"] == cluster["worker_node"], r

    # Prometheus: the API's requests (both worker processes of the second one), jobs by
    # status, and the surviving controller's passes
    scraped = httpx.get(f"{cluster['apis'][1]}/metrics", timeout=30).text
    assert 'tunefleet_jobs{status="succeeded"} 2.0' in scraped
    assert 'route="/v1/chat/completions",status="200"}' in scraped
    survivor = next(url for url, proc, _ in cluster["controllers"] if proc.poll() is None)
    scraped = httpx.get(survivor.replace("/healthz", "/metrics"), timeout=30).text
    assert "tunefleet_controller_pass_seconds_count" in scraped
    assert "tunefleet_queue_length 0.0" in scraped


def test_a_replica_serve_replaces_loads_the_most_requested_adapters_before_any_request(
    cluster: dict[str, Any],
) -> None:
    """The controller ranks adapters by the requests replicas counted over the last hour
    and stores the ranking with the serving configuration in S3; a replica Serve starts
    in place of one that died (``ray.kill``, as a lost pod) loads those adapters before it
    takes traffic: its own listing, the first request it gets, shows them loaded. Runs
    after the failover test (its two tenants' adapters), before the node is lost."""
    import ray
    from openai import OpenAI

    models = {}
    for i, (tenant, key) in enumerate(cluster["keys"].items()):
        client = OpenAI(base_url=f"{cluster['apis'][i]}/v1", api_key=key, max_retries=0)
        job = next(j for j in client.fine_tuning.jobs.list() if j.status == "succeeded")
        models[tenant] = (client, job.id, job.fine_tuned_model or "")
    for tenant, asked in (("acme", 3), ("globex", 1)):  # acme's more requested
        client, _, model = models[tenant]
        for _ in range(asked):
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
    store = cluster["store"]
    busiest = [models["acme"][1], models["globex"][1]]
    deadline = time.monotonic() + 60
    while True:  # the next push reports the requests; the controller stores the ranking
        try:
            stored = json.loads(b"".join(store.read_chunks(store.serving_key(TINY))))
        except FileNotFoundError:
            stored = {}
        if stored.get("warm") == busiest:
            break
        assert time.monotonic() < deadline, stored
        time.sleep(0.5)

    ray.init(address=cluster["head"].address, log_to_driver=False)
    try:

        def replicas() -> set[str]:
            return {
                a["name"]
                for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith("SERVE_REPLICA::") and "LoraServer" in a["name"]
            }

        (old,) = replicas()
        ray.kill(ray.get_actor(old, namespace="serve"), no_restart=True)
        deadline = time.monotonic() + 180
        while not (new := replicas() - {old}):
            assert time.monotonic() < deadline, "Serve did not replace the replica"
            time.sleep(0.5)
    finally:
        ray.shutdown()
    serve = f"http://127.0.0.1:{cluster['env']['TUNEFLEET_SERVE_PORT']}/models/{TINY}/v1"
    secret = {SECRET_HEADER: cluster["env"]["TUNEFLEET_SERVE_SECRET"]}
    deadline = time.monotonic() + 180
    while True:  # the proxy routes to it once its constructor (and warm-up) returned
        try:
            listing = httpx.get(f"{serve}/adapters", headers=secret, timeout=30)
            if listing.status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"no replica answers: {new}"
        time.sleep(0.5)
    loaded = {entry["id"]: entry for entry in listing.json()["data"]}
    assert set(loaded) == set(busiest), listing.json()
    assert all(entry["in_flight"] == 0 for entry in loaded.values()), loaded
    answer = models["acme"][0].chat.completions.create(
        model=models["acme"][2],
        messages=[{"role": "user", "content": "what is a banana"}],
        temperature=0,
        max_tokens=8,
    )
    assert answer.choices[0].message.content.strip() == ANSWERS["acme"]  # type: ignore[union-attr]


def test_a_job_whose_node_is_lost_resumes_from_its_newest_checkpoint_in_s3(
    cluster: dict[str, Any], tmp_path: Path
) -> None:
    """The second Ray node dies (SIGKILL to its whole process group, as a machine lost)
    mid-training, a replacement node already there (a spare, or Kubernetes' new pod): the
    job goes on there from its newest checkpoint in S3 and succeeds. Runs last: it kills
    the node the module's other test trains on."""
    from openai import OpenAI

    epochs, steps = 30, 60  # two steps per epoch (4 examples, batch 2)
    client = OpenAI(
        base_url=f"{cluster['apis'][0]}/v1", api_key=cluster["keys"]["globex"], max_retries=0
    )
    with _dataset(tmp_path / "globex.jsonl", ANSWERS["globex"]).open("rb") as fh:
        upload = client.files.create(file=fh, purpose="fine-tune")
    job = client.fine_tuning.jobs.create(
        model=TINY,
        training_file=upload.id,
        seed=2,
        hyperparameters={
            "n_epochs": epochs,
            "batch_size": 2,
            "learning_rate_multiplier": multiplier_for(1e-2),
        },
        extra_body={"tunefleet": {"checkpoint_every_steps": 5}},
    )
    deadline = time.monotonic() + 300
    while not (saved := list(client.fine_tuning.jobs.checkpoints.list(job.id))):
        assert time.monotonic() < deadline, "no checkpoint was saved"
        time.sleep(0.3)
    newest = max(c.step_number for c in saved)
    with ray_node(cluster["head"], num_cpus=2, resources=WORKER_RESOURCES):
        # The replacement is registered before the node dies: a job placed again while no
        # live node can hold it fails (does_not_fit_cluster) rather than waiting for one
        # (issue 38), and on a loaded machine a new node can take longer to register than
        # the controller takes to notice the loss (seen once: the job failed).
        _wait_trainers(cluster, 2)
        os.killpg(cluster["node_pid"], signal.SIGKILL)
        deadline = time.monotonic() + 600
        while (job := client.fine_tuning.jobs.retrieve(job.id)).status not in (
            "succeeded",
            "failed",
            "cancelled",
        ):
            assert time.monotonic() < deadline, "the job did not end"
            time.sleep(1)
    assert job.status == "succeeded", (job.error, _tails(cluster))

    events = list(client.fine_tuning.jobs.list_events(job.id, limit=500))[::-1]  # oldest first
    messages = [e.message for e in events]
    lost = cluster["worker_node"]
    assert any(m.startswith(f"Node(s) {lost} left the Ray cluster") for m in messages), messages
    dispatched = [e for e in events if e.message.startswith("Dispatched as Ray job")]
    assert len(dispatched) == 2, messages
    assert dispatched[0].data["nodes"] == [lost]  # type: ignore[index]
    assert dispatched[1].data["nodes"] != [lost]  # type: ignore[index]
    # the second run restored a checkpoint at least as new as the newest one listed
    resumed = [e for e in events if e.message.startswith("Training ")][-1]
    assert resumed.data["nodes"] == dispatched[1].data["nodes"]  # type: ignore[index]
    assert resumed.data["step"] >= newest > 0, resumed.message  # type: ignore[index]
    assert sum(m.startswith("The job has successfully completed") for m in messages) == 1
    steps_on_record = [e.data["step"] for e in events if e.type == "metrics"]  # type: ignore[index]
    assert max(steps_on_record) == steps
    store = cluster["store"]
    assert store.exists(store.adapter_key(job.id))


def _wait_trainers(cluster: dict[str, Any], count: int, timeout: float = 120) -> None:
    """Until ``count`` live nodes of the cluster carry the trainer resource."""
    from ray.util.state import list_nodes

    deadline = time.monotonic() + timeout
    while True:
        alive = list_nodes(address=cluster["head"].dashboard, filters=[("state", "=", "ALIVE")])
        if sum("trainer" in n.resources_total for n in alive) >= count:
            return
        assert time.monotonic() < deadline, f"{count} trainer nodes never joined: {alive}"
        time.sleep(0.5)


def messages_of(client: Any, job_id: str) -> list[str]:
    return [e.message for e in client.fine_tuning.jobs.list_events(job_id, limit=500)]


def _tails(cluster: dict[str, Any]) -> str:
    return "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in cluster["logs"])


def test_the_controllers_ray_node_runs_as_the_chart_runs_it_on_a_read_only_root(
    cluster: dict[str, Any], tmp_path: Path
) -> None:
    """The controller pod's Ray sidecar, started with the chart's command, arguments and
    environment on a root filesystem that is read-only but for its volumes (/tmp and
    /dev/shm; a user and mount namespace stands for the container), joins the cluster with
    its role label and no CPUs, and the chart's own probe of it passes. Only the ports are
    this machine's (each node of its own)."""
    if subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("this machine allows no user and mount namespaces (unshare -rm)")
    chart = render(CHART / "ci" / "s3-values.yaml")
    (spec,) = pod_specs(find(chart, "Deployment", "-controller"))
    (node,) = [c for c in spec["initContainers"] if c["name"] == "ray-node"]
    assert node["securityContext"]["readOnlyRootFilesystem"] is True
    assert {m["mountPath"] for m in node["volumeMounts"]} == {"/tmp", "/dev/shm"}
    agent = free_port()
    address = cluster["head"].address
    args = [f"--address={address}" if a.startswith("--address=") else a for a in node["args"]]
    args += [
        *("--dashboard-agent-listen-port", str(agent)),
        *("--metrics-export-port", str(free_port())),
        *("--dashboard-agent-grpc-port", str(free_port())),
        *("--runtime-env-agent-port", str(free_port())),
    ]
    env = {"PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin"}
    for item in node["env"]:
        env[item["name"]] = item.get("value") or os.environ[item["name"]]  # the token
    volume = tmp_path / "tmp"
    volume.mkdir()
    read_only = " ".join(
        str(d)
        for d in Path("/").iterdir()
        if d.is_dir() and d.name not in {"proc", "sys", "dev", "tmp"}
    )
    # The venv stands for the image's installation, which is not under /tmp: a checkout
    # under /tmp (a CI clone) would be hidden by the volume, so it stays in sight, read-only.
    venv, keep = Path(sys.prefix), ""
    if venv.is_relative_to("/tmp"):
        inside = volume / venv.relative_to("/tmp")
        keep = f"mkdir -p {inside} && mount --rbind {venv} {inside}"
        keep += f" && mount -o remount,bind,ro {inside}\n"
    script = (
        f"for d in {read_only}; do mount --rbind $d $d && mount -o remount,bind,ro $d; done\n"
        f"{keep}mount --rbind {volume} /tmp\n"
        f"touch {Path(sys.executable).parent}/written 2>/dev/null && exit 3\n"
        f"exec {shlex.join([*node['command'], *args])}\n"
    )
    log = tmp_path / "ray-node.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            ["unshare", "-rm", "bash", "-ec", script],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    token = {"Authorization": f"Bearer {os.environ['RAY_AUTH_TOKEN']}"}
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, log.read_text()[-4000:]
            reply = httpx.get(
                f"{cluster['head'].dashboard}/api/v0/nodes",
                params={"limit": 100, "detail": "true"},
                headers=token,
                timeout=30,
            ).json()
            mine = [
                n
                for n in reply["data"]["result"]["result"]
                if n["state"] == "ALIVE" and n["labels"].get(NODE_ROLE_LABEL) == "controller"
            ]
            if mine:
                break
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.5)
        assert mine[0]["resources_total"].get("CPU", 0) == 0
        probe = " ".join(node["startupProbe"]["exec"]["command"][2:])
        assert "52365" in probe
        ran = subprocess.run(
            ["bash", "-c", probe.replace("52365", str(agent))], capture_output=True, timeout=30
        )
        assert ran.returncode == 0, ran
    finally:
        stop_process(proc, grace_s=20)
