"""The Helm chart, checked offline with the real Helm: lint, render every `ci/*-values.yaml`
for Kubernetes 1.32, validate each object against Kubernetes' schemas (kubernetes-validate,
strict) and the RayCluster against KubeRay's CRD with unknown fields refused, then the
rules the chart must keep (secrets, probes, resources, GPUs, network policy, hooks, and
the elastic cluster's drains, upgrades, driver placement and node types)."""

from __future__ import annotations

import base64
import ipaddress
import json
import re
import shlex
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from ray.autoscaler._private.kuberay.autoscaling_config import _get_custom_resources
from ray.scripts.scripts import drain_node

from helmchart import (
    CHART,
    KUBE_VERSION,
    cluster_holding,
    container,
    find,
    helm,
    pod_specs,
    render,
)
from tunefleet.platform.outbound import OutboundPolicy
from tunefleet.platform.serving_contract import (
    NODE_ROLE_LABEL,
    NOT_FOR_REPLICAS,
    replica_label_selector,
)
from tunefleet.platform.settings import Settings, parse_quantity

VARIANTS = sorted((CHART / "ci").glob("*-values.yaml"))
CRD = Path(__file__).parent / "kuberay-crds" / "ray.io_rayclusters.yaml"
SECRET_NAME = re.compile(r"PASSWORD|SECRET|TOKEN|DATABASE_URL|ACCESS_KEY", re.I)


@cache
def rendered(variant: Path) -> list[dict[str, Any]]:
    return render(variant)


def variant(name: str) -> Path:
    return CHART / "ci" / f"{name}-values.yaml"


@pytest.mark.parametrize("values", VARIANTS, ids=lambda p: p.name)
def test_lint_strict(values: Path) -> None:
    # lint renders without the cluster's API versions, so it skips the KubeRay check
    out = helm(
        "lint", "--strict", str(CHART), "-f", str(values), "--kube-version", KUBE_VERSION,
        "--set", "ray.checkOperator=false", check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr


@cache
def _ray_cluster_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return schema


def unknown_fields(obj: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Fields of ``obj`` that ``schema`` does not name (a CRD's schema lets them through;
    the API server prunes them, silently)."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    found = []
    if isinstance(obj, dict) and "properties" in schema:
        for key, value in obj.items():
            if key not in schema["properties"]:
                found.append(f"{path}.{key}")
            else:
                found += unknown_fields(value, schema["properties"][key], f"{path}.{key}")
    elif isinstance(obj, dict) and isinstance(schema.get("additionalProperties"), dict):
        for key, value in obj.items():
            found += unknown_fields(value, schema["additionalProperties"], f"{path}.{key}")
    elif isinstance(obj, list) and "items" in schema:
        for i, value in enumerate(obj):
            found += unknown_fields(value, schema["items"], f"{path}[{i}]")
    return found


def validate(obj: dict[str, Any]) -> None:
    """Kubernetes 1.32's schema, strict, for built-in kinds; KubeRay's CRD for Ray's."""
    if obj["apiVersion"] == "ray.io/v1":
        schema = _ray_cluster_schema()
        jsonschema.validate(obj, schema)
        assert unknown_fields(obj, schema) == [], f"{obj['kind']} fields KubeRay does not know"
    elif obj["apiVersion"].startswith("monitoring.coreos.com/"):
        assert obj["kind"] == "ServiceMonitor"  # the Prometheus Operator's: no schema here
    else:
        kubernetes_validate.validate(obj, f"{KUBE_VERSION}.0", strict=True)


@pytest.mark.parametrize("values", VARIANTS, ids=lambda p: p.name)
def test_every_object_is_valid_for_kubernetes_1_32_and_kuberay(values: Path) -> None:
    objects = rendered(values)
    assert {o["kind"] for o in objects} >= {"Deployment", "Service", "Job"}
    for obj in objects:
        try:
            validate(obj)
        except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as exc:
            pytest.fail(f"{obj['kind']} {obj['metadata']['name']}: {exc}")


def test_unknown_fields_are_caught_in_the_ray_cluster() -> None:
    ray = find(rendered(variant("gpu")), "RayCluster", "-ray")
    ray["spec"]["headGroupSpec"]["rayStartParms"] = {}  # a typo the CRD's schema allows
    ray["spec"]["workerGroupSpecs"][1]["template"]["spec"]["containers"][0]["gpus"] = 1
    assert unknown_fields(ray, _ray_cluster_schema()) == [
        ".spec.headGroupSpec.rayStartParms",
        ".spec.workerGroupSpecs[1].template.spec.containers[0].gpus",
    ]


def test_values_schema_refuses_unknown_keys_and_wrong_types() -> None:
    for bad, named in (
        ("api.replica=3", "replica"),  # a typo of api.replicas
        ("ray.head.gpus=1", "gpus"),
        ("api.workers=0", "api.workers"),
        ("serve.proxyLocation=Everywhere", "proxyLocation"),
        ("api.forwardedAllowIps=the-ingress", "forwardedAllowIps"),  # addresses, not names
        ("api.inferenceLimits.requestsPerSecond=5000", "requestsPerSecond"),  # MAX_RATE
        ("api.inferenceLimits.concurrentRequests=-1", "concurrentRequests"),
        ("serve.adapterMemory=4GB", "adapterMemory"),  # a Kubernetes quantity: 4G or 4Gi
        ("serve.maxAdaptersPerReplica=0", "maxAdaptersPerReplica"),
    ):
        out = helm(
            "template", "t", str(CHART), "-f", str(variant("minimal")),
            "--api-versions", "ray.io/v1/RayCluster", "--set", bad, check=False,
        )  # fmt: skip
        assert out.returncode != 0 and named in out.stderr, (bad, out.stderr)


def test_without_kuberay_the_install_stops_and_names_the_operator() -> None:
    out = helm("template", "t", str(CHART), "-f", str(variant("minimal")), check=False)
    assert out.returncode != 0
    assert "KubeRay operator" in out.stderr and "kuberay/kuberay-operator" in out.stderr
    # an external Ray cluster needs no operator
    assert render(variant("existing-ray"), api_versions=())


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        ((), "Give exactly one database"),
        (("database.url=postgresql://a@b/c", "database.existingSecret=db"), "exactly one"),
        (("database.url=postgresql://a@b/c",), "artifact store"),
        (
            (
                "database.url=postgresql://a@b/c",
                "artifacts.s3.bucket=bkt",
                f"fullnameOverride={'x' * 38}",
            ),
            "longer than 37 characters",
        ),
        (
            (
                "database.url=postgresql://a@b/c",
                "artifacts.s3.bucket=bkt",
                "ray.external.address=ray:6379",
                "ray.external.dashboardUrl=http://ray:8265",
                "ray.auth.existingSecret=ray-token",
            ),
            "networkPolicy.rayAllowFrom",
        ),
    ],
)
def test_impossible_values_are_refused_with_the_fix(sets: tuple[str, ...], message: str) -> None:
    args = ["template", "t", str(CHART), "--api-versions", "ray.io/v1/RayCluster"]
    for item in sets:
        args += ["--set", item]
    out = helm(*args, check=False)
    assert out.returncode != 0 and message in out.stderr, out.stderr


def _containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        c for spec in pod_specs(obj) for c in spec.get("initContainers", []) + spec["containers"]
    ]


@pytest.mark.parametrize("values", VARIANTS, ids=lambda p: p.name)
def test_no_secret_is_a_plain_env_value(values: Path) -> None:
    text = values.read_text()
    given = yaml.safe_load(text)
    plain_secrets = [
        s
        for s in (
            given.get("database", {}).get("url", ""),
            given.get("database", {}).get("postgres", {}).get("password", ""),
        )
        if s
    ]
    for obj in rendered(values):
        for c in _containers(obj):
            for env in c.get("env", []):
                where = f"{obj['metadata']['name']}/{c['name']} {env['name']}"
                if SECRET_NAME.search(env["name"]) and env["name"] != "RAY_AUTH_MODE":
                    assert "valueFrom" in env and "value" not in env, f"{where} is plain"
                value = str(env.get("value", ""))
                assert not any(s in value for s in plain_secrets), f"{where} holds a secret"
                assert not re.search(r"://[^/@\s]+:[^/@\s]+@", value), f"{where}: credentials"


@pytest.mark.parametrize("values", VARIANTS, ids=lambda p: p.name)
def test_every_container_has_probes_and_resources(values: Path) -> None:
    for obj in rendered(values):
        for c in _containers(obj):
            where = f"{obj['kind']} {obj['metadata']['name']}/{c['name']}"
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c.get("resources", {}).get(kind, {})), where
            if obj["kind"] == "Job":  # runs to its end: no probes
                continue
            assert "livenessProbe" in c, where
            assert "readinessProbe" in c or c.get("restartPolicy") == "Always", where
        if obj["kind"] == "RayCluster":
            assert obj["spec"]["autoscalerOptions"]["resources"]["limits"]


@pytest.mark.parametrize("values", VARIANTS, ids=lambda p: p.name)
def test_pods_run_as_non_root_with_read_only_roots_where_they_can(values: Path) -> None:
    for obj in rendered(values):
        heads = (
            [obj["spec"]["headGroupSpec"]["template"]["spec"]]
            if obj["kind"] == "RayCluster"
            else []
        )
        for spec in pod_specs(obj):
            assert spec["securityContext"]["runAsNonRoot"] is True
            # the head's autoscaler calls the Kubernetes API; nothing else needs a token
            assert spec["automountServiceAccountToken"] is (spec in heads)
        if obj["kind"] in ("Deployment", "Job"):  # the TuneFleet processes
            for c in _containers(obj):
                assert c["securityContext"]["readOnlyRootFilesystem"] is True, c["name"]
                assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]


def test_gpu_groups_request_gpus_scale_from_zero_and_land_on_gpu_nodes() -> None:
    ray = find(rendered(variant("gpu")), "RayCluster", "-ray")
    assert ray["spec"]["enableInTreeAutoscaling"] is True
    assert ray["spec"]["authOptions"] == {"mode": "token", "secretName": "tf-tunefleet-ray-token"}
    head = ray["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    # Serve replicas keep off the head (a Ray node label the replicas' selector excludes)
    role = head["labels"][NODE_ROLE_LABEL]
    assert role in NOT_FOR_REPLICAS and replica_label_selector() == {
        NODE_ROLE_LABEL: f"!in({','.join(NOT_FOR_REPLICAS)})"
    }
    groups = {g["groupName"]: g for g in ray["spec"]["workerGroupSpecs"]}
    assert set(groups) == {"cpu", "a100", "h100x8"}
    for name, gpus in (("a100", 1), ("h100x8", 8)):
        group = groups[name]
        assert group["minReplicas"] == 0 and group["replicas"] == 0
        # replicas serve from the CPU group: a GPU group that trains scales to zero
        assert group["labels"][NODE_ROLE_LABEL] in NOT_FOR_REPLICAS
        spec = group["template"]["spec"]
        (worker,) = spec["containers"]
        assert worker["resources"]["limits"]["nvidia.com/gpu"] == gpus
        assert worker["image"].endswith("-cuda")
        assert spec["tolerations"] == [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
        ]
        assert "cloud.google.com/gke-accelerator" in spec["nodeSelector"]
        shm = next(v for v in spec["volumes"] if v["name"] == "shm")
        assert shm["emptyDir"]["medium"] == "Memory"
    cpu = groups["cpu"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in cpu["resources"]["limits"]
    assert not cpu["image"].endswith("-cuda")
    # ray.extraEnv (an integration's credentials) on every Ray pod, from its Secret
    wandb = {
        "name": "WANDB_API_KEY",
        "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "api-key"}},
    }
    pods = [head["template"]["spec"], *(g["template"]["spec"] for g in groups.values())]
    assert all(wandb in pod["containers"][0]["env"] for pod in pods)


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def test_ray_and_serve_are_reachable_from_tunefleet_pods_alone() -> None:
    objects = rendered(variant("s3"))
    policy = find(objects, "NetworkPolicy", "-ray")
    ray = find(objects, "RayCluster", "-ray")
    pods = {
        "api": find(objects, "Deployment", "-api")["spec"]["template"]["metadata"]["labels"],
        "controller": find(objects, "Deployment", "-controller")["spec"]["template"]["metadata"][
            "labels"
        ],
        "migrate": find(objects, "Job", "-migrate")["spec"]["template"]["metadata"]["labels"],
        "head": ray["spec"]["headGroupSpec"]["template"]["metadata"]["labels"],
        "worker": ray["spec"]["workerGroupSpecs"][0]["template"]["metadata"]["labels"],
        "postgres": find(objects, "StatefulSet", "-postgres")["spec"]["template"]["metadata"][
            "labels"
        ],
        "another release's pod": {"tunefleet.io/member": "other", "tunefleet.io/ray-node": "true"},
        "any other pod": {"app": "something"},
    }
    guarded = {
        name for name, labels in pods.items() if _selects(policy["spec"]["podSelector"], labels)
    }
    assert guarded == {"controller", "head", "worker"}  # every Ray node of this release
    (members, health) = policy["spec"]["ingress"]
    allowed = {
        name
        for name, labels in pods.items()
        if any(_selects(peer["podSelector"], labels) for peer in members["from"])
    }
    assert allowed == {"api", "controller", "migrate", "head", "worker"}
    assert "ports" not in members  # every Ray port, among members
    assert health == {"ports": [{"port": 8090, "protocol": "TCP"}]} and "from" not in health
    # Serve's port is on the head, which the policy guards
    (head,) = ray["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    head_ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert head_ports["serve"] == 8000 and head_ports["dashboard"] == 8265
    # PostgreSQL: the API, the controllers and the migrations alone; not Ray's pods, where
    # runs and tenants' code execute (runs never touch the database)
    database = find(objects, "NetworkPolicy", "-postgres")
    assert _selects(database["spec"]["podSelector"], pods["postgres"])
    (rule,) = database["spec"]["ingress"]
    assert rule["ports"] == [{"port": 5432, "protocol": "TCP"}]
    reaching = {
        name
        for name, labels in pods.items()
        if any(_selects(peer["podSelector"], labels) for peer in rule["from"])
    }
    assert reaching == {"api", "controller", "migrate"}

    # Egress of Ray's workers: this release's pods, DNS, public addresses; the head (its
    # autoscaler calls the Kubernetes API) and the controllers' Ray nodes are not held
    egress = find(objects, "NetworkPolicy", "-ray-egress")
    held = {
        name for name, labels in pods.items() if _selects(egress["spec"]["podSelector"], labels)
    }
    assert held == {"worker"}
    assert egress["spec"]["policyTypes"] == ["Egress"]
    members_rule, dns, public = egress["spec"]["egress"]
    assert _selects(members_rule["to"][0]["podSelector"], pods["head"])
    assert dns == {"ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]}
    v4, v6 = (peer["ipBlock"] for peer in public["to"])
    assert (v4["cidr"], v6["cidr"]) == ("0.0.0.0/0", "::/0")
    # what the outbound policy refuses, the network refuses too
    for address in ("169.254.169.254", "10.1.2.3", "172.20.0.1", "192.168.1.1", "100.64.0.9"):
        ip = ipaddress.ip_address(address)
        assert any(ip in ipaddress.ip_network(n) for n in v4["except"]), address
        assert not OutboundPolicy().address_allowed(ip)
    assert "fc00::/7" in v6["except"] and "fe80::/10" in v6["except"]
    opened = render(variant("s3"), "networkPolicy.rayEgressTo[0].ipBlock.cidr=169.254.169.254/32")
    assert find(opened, "NetworkPolicy", "-ray-egress")["spec"]["egress"][3] == {
        "to": [{"ipBlock": {"cidr": "169.254.169.254/32"}}]
    }
    off = render(variant("s3"), "networkPolicy.rayWorkerEgress=false")
    assert not [o for o in off if o["metadata"]["name"].endswith("-ray-egress")]


def test_hooks_migrate_after_the_database_secret_and_keep_failed_jobs() -> None:
    def hooks(objects: list[dict[str, Any]]) -> dict[str, tuple[str, int, str]]:
        return {
            f"{o['kind']}/{o['metadata']['name']}": (
                o["metadata"]["annotations"]["helm.sh/hook"],
                int(o["metadata"]["annotations"]["helm.sh/hook-weight"]),
                o["metadata"]["annotations"]["helm.sh/hook-delete-policy"],
            )
            for o in objects
            if "helm.sh/hook" in o["metadata"].get("annotations", {})
        }

    assert hooks(rendered(variant("minimal"))) == {
        # the URL's Secret first (weight -10), then the Job that needs it
        "Secret/tf-tunefleet-database": ("pre-install,pre-upgrade", -10, "before-hook-creation"),
        # a failed Job stays (for its logs) until the next release's replaces it
        "Job/tf-tunefleet-migrate": (
            "pre-install,pre-upgrade",
            0,
            "before-hook-creation,hook-succeeded",
        ),
    }
    # a Secret you manage: the Job alone
    assert list(hooks(rendered(variant("gpu")))) == ["Job/tf-tunefleet-migrate"]
    # the bundled PostgreSQL does not exist before the install: migrate after it
    assert hooks(rendered(variant("s3")))["Job/tf-tunefleet-migrate"][0] == (
        "post-install,pre-upgrade"
    )
    job = find(rendered(variant("minimal")), "Job", "-migrate")
    # the chart's ServiceAccount does not exist yet when a pre-install hook runs
    assert "serviceAccountName" not in job["spec"]["template"]["spec"]


def test_every_tunefleet_setting_the_chart_sets_is_one_the_application_reads() -> None:
    known = {f"TUNEFLEET_{name.upper()}" for name in Settings.model_fields}
    for values in VARIANTS:
        for obj in rendered(values):
            for c in _containers(obj):
                names = {e["name"] for e in c.get("env", []) if e["name"].startswith("TUNEFLEET_")}
                assert names <= known, (values.name, c["name"], names - known)


def test_the_controller_attaches_to_a_ray_node_of_its_own_pod() -> None:
    controller = find(rendered(variant("minimal")), "Deployment", "-controller")
    spec = controller["spec"]["template"]["spec"]
    (node,) = spec["initContainers"]
    assert node["restartPolicy"] == "Always"  # a native sidecar: up before the controller
    assert node["args"][:5] == [
        "start",
        "--address=tf-tunefleet-ray-head-svc.tunefleet.svc.cluster.local:6379",
        "--num-cpus=0",
        "--num-gpus=0",
        f"--labels={NODE_ROLE_LABEL}=controller",  # no Serve replica there
    ]
    assert "controller" in NOT_FOR_REPLICAS
    # its health is the raylet's, asked of the node's agent
    assert "local_raylet_healthz" in " ".join(node["livenessProbe"]["exec"]["command"])
    main = container(controller, "controller")
    shared = {m["name"] for m in node["volumeMounts"]} & {m["name"] for m in main["volumeMounts"]}
    assert shared == {"tmp", "shm"}  # the raylet's sockets and the object store
    env = {e["name"]: e for e in main["env"]}
    assert env["TUNEFLEET_RAY_ADDRESS"]["value"] == node["args"][1].removeprefix("--address=")
    assert env["RAY_AUTH_TOKEN"]["valueFrom"] == {
        "secretKeyRef": {"name": "tf-tunefleet-ray-token", "key": "auth_token"}
    }


def test_service_monitor_only_where_the_cluster_has_the_api() -> None:
    kinds = [o["kind"] for o in rendered(variant("s3"))]
    assert kinds.count("ServiceMonitor") == 1
    without = render(variant("s3"), api_versions=("ray.io/v1/RayCluster",))
    assert "ServiceMonitor" not in [o["kind"] for o in without]


def test_with_a_metrics_token_the_service_monitor_sends_what_the_services_ask_for() -> None:
    """tests/api/test_metrics.py: with TUNEFLEET_METRICS_TOKEN set, /metrics answers its
    bearer alone; the chart gives the API and the controllers the Secret's token and the
    ServiceMonitor the same Secret for each endpoint."""
    objects = render(variant("s3"), "serviceMonitor.tokenSecret=scrape")
    ref = {"name": "scrape", "key": "token"}
    for deployment, name in (("-api", "api"), ("-controller", "controller")):
        env = {
            e["name"]: e for e in container(find(objects, "Deployment", deployment), name)["env"]
        }
        assert env["TUNEFLEET_METRICS_TOKEN"]["valueFrom"]["secretKeyRef"] == ref
    endpoints = find(objects, "ServiceMonitor", "")["spec"]["endpoints"]
    assert [e["port"] for e in endpoints] == ["http", "health"]
    for endpoint in endpoints:
        assert endpoint["authorization"] == {"type": "Bearer", "credentials": ref}
    plain = find(rendered(variant("s3")), "ServiceMonitor", "")["spec"]["endpoints"]
    assert [e["port"] for e in plain] == ["http", "health"]
    assert not [e for e in plain if "authorization" in e]


def test_the_operators_outbound_allowlist_reaches_the_api_and_the_controllers() -> None:
    """tests/platform/test_outbound.py: TUNEFLEET_OUTBOUND_ALLOW, a JSON list, is what the
    API checks webhook and MLflow addresses against when they are given, and what the
    controllers check them against when they connect (and hand on to runs)."""
    objects = render(
        variant("s3"), "outbound.allow[0]=10.0.3.7/32", "outbound.allow[1]=mlflow.internal"
    )
    for deployment, name in (("-api", "api"), ("-controller", "controller")):
        env = {
            e["name"]: e for e in container(find(objects, "Deployment", deployment), name)["env"]
        }
        allow = json.loads(env["TUNEFLEET_OUTBOUND_ALLOW"]["value"])
        assert allow == ["10.0.3.7/32", "mlflow.internal"]
        assert Settings(outbound_allow=allow).outbound_policy.host_allowed("mlflow.internal")
    plain = container(find(rendered(variant("s3")), "Deployment", "-api"), "api")["env"]
    assert "TUNEFLEET_OUTBOUND_ALLOW" not in {e["name"] for e in plain}  # public only


def test_ingress_and_autoscaler_for_the_api() -> None:
    objects = rendered(variant("ingress-hpa"))
    ingress = find(objects, "Ingress", "-api")
    assert ingress["spec"]["tls"] == [
        {"hosts": ["tunefleet.example.com"], "secretName": "tunefleet-tls"}
    ]
    hpa = find(objects, "HorizontalPodAutoscaler", "-api")
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 12)
    assert "replicas" not in find(objects, "Deployment", "-api")["spec"]  # the HPA's to set
    assert find(objects, "PodDisruptionBudget", "-api")["spec"]["minAvailable"] == 1


def test_the_api_believes_its_ingress_about_the_scheme_and_no_one_else_without_one() -> None:
    """The session cookie is Secure behind the ingress's TLS only if the API believes the
    ingress's X-Forwarded-Proto (tests/api/test_ui.py, the cookie behind a proxy)."""

    def believed(*sets: str) -> str:
        objects = (
            render(variant("ingress-hpa"), *sets) if sets else rendered(variant("ingress-hpa"))
        )
        env = {e["name"]: e for e in container(find(objects, "Deployment", "-api"), "api")["env"]}
        return str(env["TUNEFLEET_FORWARDED_ALLOW_IPS"]["value"])

    assert believed() == "*"  # the ingress's pods, wherever they run
    assert believed("api.forwardedAllowIps=10.2.0.0/16") == "10.2.0.0/16"
    assert believed("api.ingress.enabled=false") == "127.0.0.1"


def test_the_api_gets_the_inference_limits() -> None:
    def limits(*sets: str) -> tuple[str, str]:
        objects = render(variant("minimal"), *sets) if sets else rendered(variant("minimal"))
        env = {e["name"]: e for e in container(find(objects, "Deployment", "-api"), "api")["env"]}
        return (
            str(env["TUNEFLEET_INFERENCE_REQUESTS_PER_S"]["value"]),
            str(env["TUNEFLEET_INFERENCE_CONCURRENT_REQUESTS"]["value"]),
        )

    assert limits() == ("20", "16")  # the API's own defaults (settings.py)
    assert limits("api.inferenceLimits.requestsPerSecond=5") == ("5", "16")
    assert limits("api.inferenceLimits.concurrentRequests=0") == ("20", "0")


def test_the_readme_installs_with_the_minimal_values_the_tests_render() -> None:
    readme = (CHART.parents[1] / "README.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", readme, re.S)
    minimal = yaml.safe_load(variant("minimal").read_text())
    assert minimal in [yaml.safe_load(b) for b in blocks]
    docs = (CHART.parents[1] / "docs" / "kubernetes.md").read_text()
    assert minimal in [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", docs, re.S)]
    for command in re.findall(r"^helm install .*$", readme, re.M):
        assert command in docs, command


def test_a_generated_postgres_password_never_shows_in_a_pod_spec() -> None:
    objects = rendered(variant("s3"))
    (secret,) = [
        o for o in objects if o["kind"] == "Secret" and "password" in o.get("stringData", {})
    ]
    password = secret["stringData"]["password"]
    assert len(password) >= 32 and password in secret["stringData"]["url"]
    for obj in objects:
        if obj["kind"] != "Secret":
            assert password not in yaml.safe_dump(obj)


def test_every_api_pod_signs_dashboard_sessions_with_one_kept_secret() -> None:
    """A session cookie one API pod signed is good at the others: the key is a Secret the
    chart makes once (or the operator's own), not a file each pod makes for itself."""
    objects = rendered(variant("minimal"))
    env = {e["name"]: e for e in container(find(objects, "Deployment", "-api"), "api")["env"]}
    ref = env["TUNEFLEET_UI_SECRET"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "tf-tunefleet-ui", "key": "secret"}, ref
    secret = find(objects, "Secret", "-ui")
    assert secret["metadata"]["name"] == ref["name"] and len(secret["data"]["secret"]) >= 32
    own = render(variant("minimal"), "api.uiExistingSecret=mine")
    env = {e["name"]: e for e in container(find(own, "Deployment", "-api"), "api")["env"]}
    assert env["TUNEFLEET_UI_SECRET"]["valueFrom"]["secretKeyRef"]["name"] == "mine"
    assert not [o for o in own if o["kind"] == "Secret" and o["metadata"]["name"].endswith("-ui")]


def _ray_cluster(values: Path, *sets: str) -> dict[str, Any]:
    return find(render(values, *sets) if sets else rendered(values), "RayCluster", "-ray")


def _controller_env(objects: list[dict[str, Any]]) -> dict[str, str]:
    controller = container(find(objects, "Deployment", "-controller"), "controller")
    return {e["name"]: e.get("value", "") for e in controller["env"]}


def test_upgrades_recreate_the_ray_pods() -> None:
    """`helm upgrade` with a changed RayCluster (a new image) replaces every Ray pod, not
    only the API's and controllers'; `None` leaves them, as before."""
    assert _ray_cluster(variant("minimal"))["spec"]["upgradeStrategy"] == {"type": "Recreate"}
    kept = _ray_cluster(variant("minimal"), "ray.upgradeStrategy=None")
    assert kept["spec"]["upgradeStrategy"] == {"type": "None"}
    out = helm(
        "template", "t", str(CHART), "-f", str(variant("minimal")),
        "--api-versions", "ray.io/v1/RayCluster", "--set", "ray.upgradeStrategy=Rolling",
        check=False,
    )  # fmt: skip
    assert out.returncode != 0 and "upgradeStrategy" in out.stderr, out.stderr


def _pre_stop(pod: dict[str, Any]) -> str:
    (ray,) = pod["containers"]
    shell, flag, script = ray["lifecycle"]["preStop"]["exec"]["command"]
    assert (shell, flag) == ("bash", "-c")
    return str(script)


@pytest.mark.parametrize(
    ("sets", "grace"), [((), 120), (("ray.terminationGracePeriodSeconds=300",), 300)]
)
def test_a_stopping_ray_worker_drains_its_node_first(sets: tuple[str, ...], grace: int) -> None:
    """Every worker pod's preStop hook drains its own Ray node (a preemption, with a
    deadline short of the grace period) and waits that long; the head is not drained but
    keeps the GCS up a little longer, so the workers' drains (an upgrade stops every pod at
    once) reach it."""
    ray = _ray_cluster(variant("gpu"), *sets)
    workers = [g["template"]["spec"] for g in ray["spec"]["workerGroupSpecs"]]
    assert len(workers) == 3
    for pod in workers:
        assert pod["terminationGracePeriodSeconds"] == grace
        drain, wait = _pre_stop(pod).split(" && ")
        ray_cli, command, *args = shlex.split(drain)
        assert (ray_cli, command) == ("ray", "drain-node")
        # the flags as the Ray the image runs (the project's) parses them
        params = drain_node.make_context("drain-node", args).params
        assert params["node_id"] is None  # this pod's own node
        assert params["address"] is None  # RAY_ADDRESS, which KubeRay sets
        assert params["reason"] == "DRAIN_NODE_REASON_PREEMPTION"
        assert params["reason_message"] == "pod $HOSTNAME terminating"  # bash expands it
        deadline = params["deadline_remaining_seconds"]
        assert deadline == grace - 15 and wait == f"sleep {deadline}"
    head = ray["spec"]["headGroupSpec"]["template"]["spec"]
    assert head["terminationGracePeriodSeconds"] == grace
    hold = _pre_stop(head)
    assert "drain-node" not in hold
    assert hold.endswith(f"| grep -q success && sleep {grace - 10}") and "gcs_healthz" in hold
    out = helm(
        "template", "t", str(CHART), "-f", str(variant("minimal")),
        "--api-versions", "ray.io/v1/RayCluster", "--set", "ray.terminationGracePeriodSeconds=20",
        check=False,
    )  # fmt: skip
    assert out.returncode != 0 and "terminationGracePeriodSeconds" in out.stderr, out.stderr


def test_the_heads_probes_check_the_gcs_and_the_workers_the_raylet() -> None:
    """KubeRay's own probe commands: the head's ask the raylet and the GCS (with the head's
    longer timeout), a worker's its raylet alone."""
    raylet = "wget -T 2 -q -O- http://localhost:52365/api/local_raylet_healthz | grep success"
    gcs = "wget -T 10 -q -O- http://localhost:8265/api/gcs_healthz | grep success"
    ray = _ray_cluster(variant("gpu"))
    (head,) = ray["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    for probe in ("livenessProbe", "readinessProbe"):
        assert head[probe]["exec"]["command"] == ["bash", "-c", f"{raylet} && {gcs}"]
        assert head[probe]["timeoutSeconds"] == 5
        for group in ray["spec"]["workerGroupSpecs"]:
            (worker,) = group["template"]["spec"]["containers"]
            assert worker[probe]["exec"]["command"] == ["bash", "-c", raylet]
            assert worker[probe]["timeoutSeconds"] == 2


def test_the_bundled_postgres_password_outlives_uninstall_and_is_read_back() -> None:
    """The generated password's Secret carries Helm's keep policy (`helm uninstall` leaves
    it, as it leaves the database's volume) and is an ordinary object, not a hook (Helm
    ignores the policy on hooks). Installed again where it exists, the chart's lookup reads
    its password back instead of making a new one the old data would refuse."""
    secret = find(rendered(variant("s3")), "Secret", "-database")
    annotations = secret["metadata"]["annotations"]
    assert annotations == {"helm.sh/resource-policy": "keep"}  # no helm.sh/hook
    generated = secret["stringData"]["password"]
    assert len(generated) >= 32  # offline, lookup finds nothing: a new one
    first = "the-first-installs-password"
    kept = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "tf-tunefleet-database", "namespace": "tunefleet"},
        "data": {"password": base64.b64encode(first.encode()).decode()},
    }
    with cluster_holding(kept) as kubeconfig:
        again = find(render(variant("s3"), kubeconfig=kubeconfig), "Secret", "-database")
    assert again["stringData"]["password"] == first
    assert f"tunefleet:{first}@tf-tunefleet-postgres:5432" in again["stringData"]["url"]


def test_gcs_fault_tolerance_through_redis_is_opt_in() -> None:
    ft = _ray_cluster(variant("gcs-ft"))["spec"]["gcsFaultToleranceOptions"]
    assert ft == {
        "redisAddress": "redis.redis.svc.cluster.local:6379",
        "redisPassword": {
            "valueFrom": {"secretKeyRef": {"name": "tunefleet-redis", "key": "password"}}
        },
        "externalStorageNamespace": "tunefleet",
    }
    bare = _ray_cluster(variant("gcs-ft"), "ray.gcsFaultTolerance.redisPasswordSecret.name=")
    assert bare["spec"]["gcsFaultToleranceOptions"] == {
        "redisAddress": "redis.redis.svc.cluster.local:6379",
        "externalStorageNamespace": "tunefleet",
    }
    assert "gcsFaultToleranceOptions" not in _ray_cluster(variant("minimal"))["spec"]
    for bad, named in (
        ("ray.gcsFaultTolerance.enabled=true", "redisAddress"),
        ("ray.gcsFaultTolerance.redisPasswordSecret.name=redis", "key"),
    ):
        out = helm(
            "template", "t", str(CHART), "-f", str(variant("minimal")),
            "--api-versions", "ray.io/v1/RayCluster", "--set", bad, check=False,
        )  # fmt: skip
        assert out.returncode != 0 and named in out.stderr, (bad, out.stderr)


def _offered(group: dict[str, Any]) -> dict[str, int]:
    """A group's custom Ray resources as Ray's autoscaler reads them from the RayCluster;
    checked against what `ray start` gets through KubeRay's shell command line and what
    KubeRay's own parser (quotes trimmed, JSON) makes of them."""
    params = group.get("rayStartParams", {})
    offered: dict[str, int] = _get_custom_resources({}, params, group.get("groupName", "head"))
    if "resources" in params:
        (argument,) = shlex.split(f"--resources={params['resources']}")
        assert json.loads(argument.removeprefix("--resources=")) == offered
        assert json.loads(params["resources"].strip("'\"` ")) == offered
    return offered


def test_run_drivers_land_on_workers_whose_pods_hold_no_token() -> None:
    """Each run's driver asks for a resource every worker advertises and the head does
    not, so it never runs beside the head's ServiceAccount token (the autoscaler's); no
    worker pod mounts a token."""
    objects = rendered(variant("gpu"))
    ray = find(objects, "RayCluster", "-ray")
    driver = json.loads(_controller_env(objects)["TUNEFLEET_RUN_DRIVER_RESOURCES"])
    assert driver == {"tunefleet-driver": 1}
    head = ray["spec"]["headGroupSpec"]
    assert _offered(head) == {} and "resources" not in head
    assert head["template"]["spec"]["automountServiceAccountToken"] is True
    for group in ray["spec"]["workerGroupSpecs"]:
        assert _offered(group) == {"tunefleet-driver": 100}, group["groupName"]
        assert group["template"]["spec"]["automountServiceAccountToken"] is False
    # an external Ray cluster's resources are its own: the chart sets neither setting
    env = _controller_env(rendered(variant("existing-ray")))
    assert not {"TUNEFLEET_RUN_DRIVER_RESOURCES", "TUNEFLEET_NODE_TYPES"} & set(env)


def _cpus(quantity: str | int | float) -> float:
    text = str(quantity)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


@pytest.mark.parametrize(
    ("name", "sets"),
    [("gpu", ()), ("minimal", ()), ("minimal", ("ray.cpuWorkers.resources.limits.cpu=500m",))],
)
def test_the_controller_knows_the_node_types_of_the_worker_groups(
    name: str, sets: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    objects = render(variant(name), *sets)
    groups = find(objects, "RayCluster", "-ray")["spec"]["workerGroupSpecs"]
    expected = []
    for group in groups:
        (worker,) = group["template"]["spec"]["containers"]
        limits = worker["resources"]["limits"]
        expected.append(
            {
                "name": group["groupName"],
                "cpus": _cpus(limits["cpu"]),
                "gpus": limits.get("nvidia.com/gpu", 0),
                "resources": _offered(group),
                "max_count": group["maxReplicas"],
                # KubeRay starts Ray with --memory set to the pod's memory limit
                "memory": limits["memory"],
                **({"labels": group["labels"]} if "labels" in group else {}),
            }
        )
    node_types = json.loads(_controller_env(objects)["TUNEFLEET_NODE_TYPES"])
    assert node_types == expected
    if name == "gpu":  # a CPU group serves: replicas keep off the GPU groups
        assert [t.get("labels") for t in node_types] == [None] + [{NODE_ROLE_LABEL: "training"}] * 2
    assert [t["name"] for t in node_types] == (
        ["cpu", "a100", "h100x8"] if name == "gpu" else ["cpu"]
    )
    if sets:
        assert node_types[0]["cpus"] == 0.5
    # and the controller reads both as the chart writes them
    env = _controller_env(objects)
    for key in ("TUNEFLEET_NODE_TYPES", "TUNEFLEET_RUN_DRIVER_RESOURCES"):
        monkeypatch.setenv(key, env[key])
    read = Settings()
    assert [t.model_dump() for t in read.node_types] == [
        {"labels": {}, **t, "memory": parse_quantity(t["memory"])} for t in expected
    ]
    assert read.run_driver_resources == {"tunefleet-driver": 1}


def test_pods_that_cache_artifacts_request_the_cache_and_tell_the_app_its_size() -> None:
    """With object storage, every container that mounts the artifact cache requests the
    cache volume's size as ephemeral storage (the kubelet then does not evict the pod for
    it) and gets that size as TUNEFLEET_ARTIFACT_CACHE_SIZE, which the application reads
    to keep its copies within 90% of it. A local store caches nothing: no request."""

    def caching(objects: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any], str]]:
        found = []
        for obj in objects:
            for spec in pod_specs(obj):
                (volume,) = [v for v in spec.get("volumes", []) if v["name"] == "cache"] or [None]
                for c in spec["containers"]:
                    if volume and any(m["name"] == "cache" for m in c.get("volumeMounts", [])):
                        found.append((obj["metadata"]["name"], c, volume["emptyDir"]["sizeLimit"]))
        return found

    s3 = caching(render(variant("s3"), "artifacts.cacheSize=50Gi"))
    assert {name.rsplit("-", 1)[-1] for name, _, _ in s3} >= {"api", "controller", "ray"}
    for name, c, size in s3:
        assert size == "50Gi", name
        assert c["resources"]["requests"]["ephemeral-storage"] == "50Gi", name
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["TUNEFLEET_ARTIFACT_CACHE_SIZE"] == "50Gi", name
        settings = Settings(artifact_cache_size=env["TUNEFLEET_ARTIFACT_CACHE_SIZE"])
        assert settings.artifact_cache_size == 50 << 30
    local = rendered(variant("external-db"))  # a shared claim, no object storage
    assert caching(local)
    for name, c, _ in caching(local):
        assert "ephemeral-storage" not in c["resources"].get("requests", {}), name


def test_ray_pods_keep_a_model_cache_of_its_size_where_it_is_on() -> None:
    """`models.nodeCacheSize` gives every Ray pod (head and each worker group, the pods
    where replicas and training workers load base models) an emptyDir of that size at
    TUNEFLEET_MODEL_CACHE, requested as ephemeral storage beside the artifact cache (their
    sum in bytes), and the size as a setting the application reads. No other pod gets
    it, and without the value no pod does."""
    objects = render(variant("s3"), "models.nodeCacheSize=8Gi", "artifacts.cacheSize=50Gi")
    (ray_cluster,) = [o for o in objects if o["kind"] == "RayCluster"]
    specs = pod_specs(ray_cluster)
    assert len(specs) >= 2  # the head and the CPU group
    for spec in specs:
        (volume,) = [v for v in spec["volumes"] if v["name"] == "model-cache"]
        assert volume["emptyDir"]["sizeLimit"] == "8Gi"
        (c,) = spec["containers"]
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "model-cache"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["TUNEFLEET_MODEL_CACHE"].startswith(mount["mountPath"] + "/")
        read = Settings(
            model_cache=env["TUNEFLEET_MODEL_CACHE"],
            model_cache_size=env["TUNEFLEET_MODEL_CACHE_SIZE"],
        )
        assert read.model_cache_size == 8 << 30
        assert int(c["resources"]["requests"]["ephemeral-storage"]) == (8 + 50) << 30
    for obj in objects:
        if obj["kind"] != "RayCluster":
            for spec in pod_specs(obj):
                assert all(v["name"] != "model-cache" for v in spec.get("volumes", []))
    off = [o for o in rendered(variant("s3")) if o["kind"] == "RayCluster"]
    for spec in pod_specs(off[0]):
        assert all(v["name"] != "model-cache" for v in spec["volumes"])
        assert "TUNEFLEET_MODEL_CACHE_SIZE" not in {e["name"] for e in spec["containers"][0]["env"]}
    bad = helm(
        "template", "t", str(CHART), "-f", str(variant("minimal")),
        "--set", "models.nodeCacheSize=8 GB", "--set", "ray.checkOperator=false", check=False,
    )  # fmt: skip
    assert bad.returncode != 0 and "nodeCacheSize" in bad.stderr


def test_replicas_are_told_their_adapter_memory() -> None:
    """`serve.adapterMemory` and `serve.maxAdaptersPerReplica` reach the controller, which
    deploys the replicas, as settings the application reads (a quantity, in bytes)."""
    env = _controller_env(render(variant("minimal")))
    read = Settings(
        serve_adapter_memory=env["TUNEFLEET_SERVE_ADAPTER_MEMORY"],
        serve_max_adapters_per_replica=env["TUNEFLEET_SERVE_MAX_ADAPTERS_PER_REPLICA"],
    )
    assert (read.serve_adapter_memory, read.serve_max_adapters_per_replica) == (4 << 30, 64)
    env = _controller_env(
        render(variant("minimal"), "serve.adapterMemory=512Mi", "serve.maxAdaptersPerReplica=16")
    )
    read = Settings(
        serve_adapter_memory=env["TUNEFLEET_SERVE_ADAPTER_MEMORY"],
        serve_max_adapters_per_replica=env["TUNEFLEET_SERVE_MAX_ADAPTERS_PER_REPLICA"],
    )
    assert (read.serve_adapter_memory, read.serve_max_adapters_per_replica) == (512 << 20, 16)


def test_only_the_api_may_write_the_models_claim_and_only_when_told() -> None:
    """A models claim is mounted read-only on every pod, unless `models.writable`: then the
    API's pods (which add and remove base models) mount it read-write and every other pod
    (the controller, the Ray nodes) still read-only."""

    def models_mounts(objects: list[dict[str, Any]]) -> dict[str, tuple[bool, bool]]:
        found = {}
        for obj in objects:
            for spec in pod_specs(obj):
                (volume,) = [v for v in spec.get("volumes", []) if v["name"] == "models"] or [None]
                for c in spec["containers"]:
                    for m in c.get("volumeMounts", []):
                        if m["name"] == "models":
                            assert volume is not None
                            claim = volume["persistentVolumeClaim"]
                            assert claim["claimName"] == "registry"
                            key = f"{obj['metadata']['name']}/{c['name']}"
                            found[key] = (m["readOnly"], claim["readOnly"])
        return found

    kept = models_mounts(render(variant("s3"), "models.existingClaim=registry"))
    assert {name.split("/")[0].rsplit("-", 1)[-1] for name in kept} >= {"api", "controller", "ray"}
    assert all(mount and claim for mount, claim in kept.values()), kept
    writable = models_mounts(
        render(variant("s3"), "models.existingClaim=registry", "models.writable=true")
    )
    assert writable.keys() == kept.keys()
    for name, (read_only, _claim) in writable.items():
        assert read_only == (not name.split("/")[0].endswith("-api")), name
