"""A whole kvserve cluster on this machine: nats-server and one process per service instance.

LocalCluster owns processes — it starts them, prefixes and keeps their logs,
watches heartbeats to tell when the cluster is ready, and stops them — and
knows nothing about what the services do. `kvserve up` and the integration
tests both run on it. Every child dies with the process that started it; with
``supervise=True`` one that exits is started again (kvserve/cli/supervisor.py). What
they leave on the machine (shared memory, the runtime directory with the NATS
credentials) is removed at a stop, and by a watchdog when the launcher is killed
(kvserve/cli/reaper.py).
"""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlsplit

from kvserve.cli.console import Console
from kvserve.cli.cpus import CpuShare, plan_cpus
from kvserve.cli.heartbeats import HeartbeatWatcher
from kvserve.cli.join_bundle import (
    CONTROL_ROLES,
    JOINABLE_ROLES,
    VERSION,
    BundleControl,
    BundleModel,
    BundleNats,
    BundleTls,
    BundleUser,
    JoinBundle,
    JoinedNats,
    control_plane_server,
    write_bundle,
)
from kvserve.cli.model import ModelChoiceError, resolve_model
from kvserve.cli.reaper import Reaper
from kvserve.cli.service_process import ServiceProcess, describe_exit
from kvserve.cli.supervisor import (
    HEALTHY_AFTER_SECONDS,
    RESTART_DELAY_FIRST,
    RESTART_DELAY_MAX,
    Backoff,
    Exit,
    Supervisor,
    die_with_launcher,
    remove_segments_of,
)
from libs.common import standby
from libs.common.certificates import ClusterCA, Leaf
from libs.common.cpu_share import available_cpus
from libs.common.nats_auth import OBSERVER, load_credentials, write_private
from libs.common.nats_server import NatsCluster, NatsServer
from libs.common.settings import without_secrets
from libs.common.tls import TlsFiles, mutual_context
from libs.protocol.errors import KVServeError
from libs.protocol.models import DEFAULT_MODEL_ID
from libs.protocol.schema import Heartbeat
from libs.protocol.vocabulary import Role

ROLES = (Role.CONDUCTOR, Role.STORE, Role.PREFILL, Role.DECODE, Role.GATEWAY)  # also the start order
# SIGTERM to SIGKILL. Longer than any service's own stop: the gateway drains in-flight
# requests for up to 10 s (KVSERVE_GATEWAY_DRAIN_TIMEOUT's default, DRAIN_TIMEOUT in
# services/gateway/settings.py), so twice that.
STOP_GRACE_SECONDS = 20.0
# After a spare became a worker, the next one starts this much later: its start (torch's
# import, the model's load: seconds of CPU) would otherwise compete with the recovery.
STANDBY_RESPAWN_SECONDS = 10.0
STANDBY_ROLES = (Role.PREFILL, Role.DECODE)  # the roles whose start is slow enough to keep a spare
SPARE_WAIT_SECONDS = 30.0  # start() waits at least this long for the first spares before giving up on them
DATA_PLANE_ROLES = (Role.PREFILL, Role.DECODE, Role.STORE)  # the roles that move KV (libs/transfer)
ROUTE_WAIT_SECONDS = 15.0  # a control-plane host's nats-server gets this long to route into the first host's
_STDOUT: Any = object()  # `log`'s default: sys.stdout as it is when the cluster is built, not at import


class ClusterError(KVServeError):
    """The cluster could not start, or a service in it failed."""


class LocalCluster:
    """nats-server plus conductors (``conductors``: replicas, active-active), stores
    (``store``: how many, or True for one), N prefill, M decode workers and a gateway.
    With no prefill worker (``prefill=0``) each decode worker prefills its own
    requests: the conductors' policy (``KVSERVE_POLICY`` in ``env``, else in this
    process's environment, else the default) gets ``+local_prefill`` where it lacks it,
    the decode workers divide every core (each keeps a prefix cache by its own
    settings, as in any deployment).
    With ``store_dir``, each store keeps its disk tier
    in ``store_dir/<instance id>``, so a restarted store finds its blocks.

    ``modules`` maps a role to the module run for it (``services.<role>`` by
    default), so the launcher itself can be tested with stand-in services.
    ``env`` is added to every service's environment, last. With ``metrics_port``, each
    service serves its own /metrics and /healthz on a port of its own from it up
    (`metrics_ports`).

    Each worker gets its share of this machine's cores (kvserve/cli/cpus.py): ``cpus``
    gives a worker role its own cores (``{"prefill": (0, 1), "decode": (2, 3)}``);
    the roles it leaves out share the rest. ``shared_prefill`` more prefill workers
    (numbered after the others) run on the decode workers' cores at low priority,
    prefilling with a quarter of a busy core and all of an idle one.

    With ``supervise`` and ``standby`` (the default), each worker role also keeps a warm
    spare (libs/common/standby.py): a process with the model loaded that becomes the next
    worker of its role to die, so that restart takes well under a second instead of the
    interpreter's, torch's and the model's start; a new spare starts ``STANDBY_RESPAWN_SECONDS``
    later, not while the cluster is still absorbing the death.

    With ``supervise``, once the cluster is ready any process that exits (a service
    instance or nats-server) is started again after a backoff: ``restart_delays``
    (first, longest) seconds, doubling at each exit in a row. Without it (tests that kill
    on purpose) a process that exits stays down until ``restart()``.

    Several hosts: with ``listen`` (this host's address on the network the hosts share),
    nats-server and the workers' data plane listen there, the data plane speaks mutual TLS
    from a CA this cluster makes (unless ``tls`` is False), nats-server also has a user per
    joinable role, ``decode`` may be 0 (decode hosts join), and ``join_bundle`` names where
    to write what another host needs to join (kvserve/cli/join_bundle.py). With ``member``
    (a bundle, and ``member_host``, the first host's address as reached from here) this
    is a joining host instead: no nats-server, conductor or gateway of its own, only the
    workers and stores asked for, their ids tagged with ``host_id`` (``decode-hostb-0``).
    ``host_id`` (default: the host name) tells hosts apart: peers on one host move KV
    through shared memory, others over TCP.

    A second control plane, so that the first host is no single point of failure: a first
    host with ``control_bundle`` (and a NATS cluster: ``nats_servers`` of 2 or more) also
    writes a control-plane bundle there, and a joining host with ``control_plane`` (its
    ``member`` bundle that one) runs a nats-server routed into the first host's NATS cluster,
    a conductor replica and a gateway of its own, beside its workers.
    """

    def __init__(
        self,
        *,
        prefill: int = 1,
        decode: int = 1,
        conductors: int = 1,
        store: int | bool = True,
        store_dir: str | Path | None = None,
        gateway_port: int = 8000,
        gateway_host: str = "127.0.0.1",
        nats_host: str = "127.0.0.1",
        model: str | None = None,
        dtype: str = "auto",
        device: str = "cpu",
        env: dict[str, str] | None = None,
        quantization: str = "auto",
        log: TextIO | None = _STDOUT,
        api_key: str | None = None,
        tenants_file: str | None = None,
        modules: dict[str, str] | None = None,
        supervise: bool = False,
        restart_delays: tuple[float, float] = (RESTART_DELAY_FIRST, RESTART_DELAY_MAX),
        cpus: dict[str, tuple[int, ...]] | None = None,
        shared_prefill: int = 0,
        metrics_port: int | None = None,
        standby: bool = True,
        spares_before_ready: bool = True,
        nats_servers: int = 1,
        listen: str | None = None,
        tls: bool = True,
        join_bundle: str | Path | None = None,
        member: JoinBundle | None = None,
        member_host: str | None = None,
        host_id: str | None = None,
        control_bundle: str | Path | None = None,
        control_plane: bool = False,
    ) -> None:
        if decode < 1 and listen is None and member is None:
            raise ValueError("a cluster needs at least one decode worker (0 only with listen: decode hosts join)")
        if join_bundle is not None and listen is None:
            raise ValueError("a join bundle needs listen: the address the other hosts reach this one at")
        if member is not None and (listen is None or member_host is None):
            raise ValueError("a joining host needs listen (its own address) and member_host (the first host's)")
        if control_bundle is not None and (listen is None or nats_servers < 2):
            raise ValueError("a control-plane bundle needs listen and a NATS cluster (nats_servers of 2 or more): "
                             "the other host's nats-server routes into it")  # fmt: skip
        if control_plane and (member is None or member.control is None):
            raise ValueError("a control-plane host needs a control-plane bundle as its member bundle")
        if prefill < 0 or shared_prefill < 0:
            raise ValueError(f"prefill workers: at least 0, got {min(prefill, shared_prefill)}")
        if conductors < 1:
            raise ValueError("a cluster needs at least one conductor")
        if nats_servers < 1:
            raise ValueError(f"a cluster needs at least one nats-server, got {nats_servers}")
        if unknown := set(modules or {}) - set(ROLES):
            raise ValueError(f"no such service: {', '.join(sorted(unknown))}")
        self.member = member
        self.member_host = member_host
        self.listen = listen  # None: this host alone, everything on 127.0.0.1
        self.tls = tls and (member.tls is not None if member is not None else True)
        self.join_bundle = None if join_bundle is None else Path(join_bundle)
        self.control_bundle = None if control_bundle is None else Path(control_bundle)
        self.control_plane = control_plane
        self.host_id = host_id or socket.gethostname()
        self.counts = {Role.CONDUCTOR: conductors, Role.STORE: int(store), Role.PREFILL: prefill + shared_prefill,
                       Role.DECODE: decode, Role.GATEWAY: 1}  # fmt: skip
        if member is not None:  # the first host runs those (and a control-plane host one of each)
            self.counts |= {Role.CONDUCTOR: int(control_plane), Role.GATEWAY: int(control_plane)}
            if control_plane and api_key is None and tenants_file is None:
                api_key = member.control.api_key  # the first host's, as its gateway checks it
        plan = plan_cpus(self.counts, available_cpus(), cpus, shared_prefill)
        self.cpu_plan: dict[str, CpuShare] = {  # by instance id
            self.instance_id(role, i): plan[f"{role}-{i}"] for role in ROLES for i in range(self.counts[role])
        }
        self.store_dir = Path(store_dir) if store_dir is not None else None
        self.metrics_port = metrics_port  # the first of the ports each service serves /metrics on; None: none
        self.gateway_port = gateway_port
        self.gateway_host = gateway_host
        self.nats_host = listen or nats_host  # the address nats-server listens on (another host's services must reach it)
        self.nats_servers = nats_servers  # more than one: a NATS cluster, every service given every server
        self.model = model
        self.dtype = dtype  # the explicit dtype every service gets, once start() has resolved "auto"
        self.quantization = quantization  # likewise the weights' precision (part of the KV contract)
        self.device = device
        self.api_key = api_key
        self.tenants_file = None if tenants_file is None else str(Path(tenants_file).resolve())
        self.extra_env = dict(env or {})
        self.modules = {role: f"services.{role}" for role in ROLES} | (modules or {})
        self.supervise = supervise
        self.standby = standby  # keep a warm spare per worker role (when supervising)
        # start() returns once the first spares have loaded (False: at once, their load beside
        # the first requests; bench/first_seconds.py measures both)
        self.spares_before_ready = spares_before_ready
        self.restart_delays = restart_delays
        self.model_id = ""
        self.model_path: Path | None = None
        self.gateway_url = ""  # set once ready
        self.nats_url = ""  # the admin user's, credentials included: for this process (tests) only
        self._cond = threading.Condition()  # guards the heartbeats; notified on each one and on each exit
        self._heartbeats: dict[str, Heartbeat] = {}
        self._last_seen: dict[str, float] = {}
        self._procs: dict[str, ServiceProcess] = {}
        self._spares: dict[str, ServiceProcess] = {}  # by role: warm spares, each until a worker adopts it
        self._spare_timers: list[threading.Timer] = []
        self._nats: NatsCluster | JoinedNats | None = None
        self._ca: ClusterCA | None = None  # the data plane's CA, on a first host that listens with TLS
        # this host's TLS files (a leaf, its key, the CA's certificate): for the data plane and NATS between hosts
        self._tls_files: TlsFiles | None = None
        self._watcher: HeartbeatWatcher | None = None
        self._supervisor: Supervisor | None = None  # forks every child; restarts them when supervising
        # 0700: the NATS credentials and nats-server's files, and what the services leave for their restarts
        self._runtime: tempfile.TemporaryDirectory | None = None
        self._reaper: Reaper | None = None  # removes what the cluster leaves if this process is killed
        self._nats_started_at = 0.0  # time.monotonic()
        self.gateway_id = self.instance_id(Role.GATEWAY, 0)
        ids = [self.instance_id(role, i) for role in ROLES for i in range(self.counts[role])]
        servers = [f"nats-server-{i}" for i in range(nats_servers) if nats_servers > 1]
        if control_plane:
            servers.append(self._local_nats_name)
        # (a spare's rare lines before it is adopted, say an error, may overflow the label column)
        self._console = Console(sys.stdout if log is _STDOUT else log, ids + ["kvserve", "nats-server"] + servers)

    # --- what the cluster looks like ------------------------------------------
    def instance_id(self, role: str, index: int) -> str:
        """The id of the ``index``-th instance of ``role`` started here: ``decode-0``, or on
        a joining host ``decode-<host id>-0`` (ids are the cluster's, not the host's)."""
        if self.member is None:
            return f"{role}-{index}"
        return f"{role}-{instance_tag(self.host_id)}-{index}"

    @property
    def _local_nats_name(self) -> str:
        """A control-plane host's nats-server's name, unlike any other server's in the NATS cluster."""
        return f"nats-server-{instance_tag(self.host_id)}"

    @property
    def instances(self) -> dict[str, Heartbeat]:
        """The last heartbeat of every instance heard from, by instance id (a snapshot)."""
        with self._cond:
            return dict(self._heartbeats)

    @property
    def last_seen(self) -> dict[str, float]:
        """``time.monotonic()`` of every instance's last heartbeat (a snapshot)."""
        with self._cond:
            return dict(self._last_seen)

    @property
    def pids(self) -> dict[str, int]:
        """The process id of every service instance started."""
        return {i: inst.pid for i, inst in self._procs.items() if inst.pid is not None}

    @property
    def spare_pids(self) -> dict[str, int]:
        """The warm spares' processes by role (those started and not yet adopted)."""
        with self._cond:
            return {role: spare.pid for role, spare in self._spares.items() if spare.pid is not None}

    @property
    def loaded_spares(self) -> set[str]:
        """The roles whose warm spare has loaded (said so) and waits to be adopted."""
        with self._cond:
            return {role for role, spare in self._spares.items() if spare.standby_ready.is_set()}

    def logs(self, instance_id: str) -> list[str]:
        """The last lines (up to 200) an instance wrote to stdout or stderr."""
        return list(self._instance(instance_id).tail)

    @property
    def instance_ids(self) -> list[str]:
        """Every service instance started, in start order."""
        return list(self._procs)

    @property
    def nats_pid(self) -> int | None:
        """nats-server's process id (the first one's, in a NATS cluster), while started."""
        return None if self._nats is None or not self._nats.servers else self._nats.servers[0].pid

    @property
    def nats_pids(self) -> list[int | None]:
        """Every nats-server's process id, while started."""
        return [] if self._nats is None else self._nats.pids

    @property
    def runtime_dir(self) -> Path | None:
        """The cluster's 0700 directory (NATS credentials included), while started."""
        return None if self._runtime is None else Path(self._runtime.name)

    @property
    def reaper_pid(self) -> int | None:
        """The watchdog's process id, while started (kvserve/cli/reaper.py)."""
        return None if self._reaper is None else self._reaper.pid

    @property
    def running(self) -> bool:
        """Started and not yet stopped."""
        return self._nats is not None

    # --- lifecycle ------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> None:
        """Start everything and return once every instance has sent a heartbeat and the
        gateway has reported its address, within ``timeout`` seconds of starting the
        services (preparing the model and starting nats-server are not counted), and,
        supervised with standby, once the first warm spares have loaded too.
        Raises ClusterError (having stopped everything) when that does not happen."""
        if self._nats is not None:
            raise ClusterError("this cluster is already started")
        self._supervisor = Supervisor(report=lambda text: self.echo(text, label="kvserve"))
        self._supervisor.start()
        try:
            self._resolve_model()
            self._runtime = tempfile.TemporaryDirectory(prefix="kvserve-cluster-")  # mode 0700
            if sys.platform.startswith("linux"):  # pidfds; elsewhere nothing kills the children either
                self._reaper = Reaper(self.runtime_dir)
            instances = {self.instance_id(role, i): role for role in ROLES for i in range(self.counts[role])}
            self._tls_files = self._make_tls()
            if self.member is not None:  # the first host's; each instance its role's user (join_bundle.py)
                local = None
                if self.control_plane:
                    local = control_plane_server(self.member.control, self.member_host, self.listen,
                                                 self._local_nats_name, self.runtime_dir, self._tls_files)  # fmt: skip
                    self._take_tenants()
                self._nats = JoinedNats(self.member, self.member_host, self.runtime_dir, instances, local)
            else:  # each instance its own NATS user: a restart keeps its id, so its credentials too
                joinable = JOINABLE_ROLES if self.listen is not None else ()
                joinable += CONTROL_ROLES if self.control_bundle is not None else ()
                self._nats = NatsCluster(self.nats_servers, self.nats_host, directory=self.runtime_dir,
                                         instances=instances, role_users=joinable, tls=self._tls_files)  # fmt: skip
            for server in self._nats.servers:
                server.preexec_fn = die_with_launcher()
                self._supervisor.call(server.start)
                self._tell_reaper(watch=server.pid)
                self.echo(f"{server.name} listening on {server.public_url}", label="kvserve")
            self._nats_started_at = time.monotonic()
            if self.control_plane and not self._nats.servers[0].wait_routed(OBSERVER, ROUTE_WAIT_SECONDS):
                self.echo(f"{self._local_nats_name} has no route to the first host's nats-servers within "
                          f"{ROUTE_WAIT_SECONDS:g}s; starting anyway (it keeps trying)", label="kvserve")  # fmt: skip
            self.nats_url = self._nats.url
            if self.join_bundle is not None:
                write_bundle(self.join_bundle, self._bundle())
                self.echo(f"wrote the join bundle {self.join_bundle} (0600; it holds secrets: copy it like a key)",
                          label="kvserve")  # fmt: skip
            if self.control_bundle is not None:
                write_bundle(self.control_bundle, self._bundle(control=True))
                self.echo(f"wrote the control-plane bundle {self.control_bundle} (0600; it holds every key of the "
                          "cluster: give it only to hosts you would run this one's services on)", label="kvserve")
            if not self.counts.get(Role.PREFILL) and self.member is None:  # a joining host: the others have them
                self.echo("no prefill worker: each decode worker prefills its own requests", label="kvserve")
            self._watcher = HeartbeatWatcher(
                self._nats.url_for("observer"), self._on_heartbeat, on_disconnect=self._supervisor.wake,
                tls=None if self._tls_files is None else mutual_context(self._tls_files, server=False),
            )
            self._watcher.start()
            if not self._watcher.subscribed.wait(10.0) or self._watcher.error is not None:
                why = self._watcher.error or "timed out"
                if self.member is not None:  # the first host's, as the bundle and HOST say
                    raise ClusterError(f"cannot reach the first host's nats-server at {self._nats.public_url} ({why}): "
                                       "check HOST, that its kvserve up is running, and that the bundle is the one "
                                       "it wrote this run")  # fmt: skip
                raise ClusterError(f"cannot watch heartbeats on nats-server: {why}")
            deadline = time.monotonic() + timeout
            for role in ROLES:
                for i in range(self.counts[role]):
                    self._supervisor.call(self._spawn, self._plan(role, self.instance_id(role, i)))
            self._wait_ready(deadline, timeout)
            if self.supervise:
                self._watch_all()
                if self.spares_before_ready:
                    self._wait_for_first_spares(deadline)
        except BaseException:
            self.stop()
            raise

    def _wait_for_first_spares(self, deadline: float) -> None:
        """Return once the first warm spares have loaded, so that their start (torch's import,
        the model's load: seconds of CPU on the workers' cores) is not taken out of the
        first requests. Measured here: TTFT 1.6-1.8x higher for ~5 s after the URL while
        they loaded. A spare that takes longer is not waited for past the start's deadline
        (at least SPARE_WAIT_SECONDS); the cluster serves and says so."""
        try:
            self.wait_for_spares(max(SPARE_WAIT_SECONDS, deadline - time.monotonic()))
        except TimeoutError as e:
            self.echo(f"{e}: serving without it (it keeps loading beside the requests)", label="kvserve")

    def stop(self, grace: float = STOP_GRACE_SECONDS) -> None:
        """SIGTERM the gateways, then every other service (each drains), SIGKILL any still
        running ``grace`` seconds after its SIGTERM, then stop nats-server. Safe to call
        more than once."""
        if self._supervisor is not None:
            self._supervisor.unwatch_all()  # nothing is restarted from here on
        for timer in self._spare_timers:
            timer.cancel()
        with self._cond:
            spares, self._spares = list(self._spares.values()), {}
        running = [inst for inst in list(self._procs.values()) + spares if inst.exit_code() is None]
        # The gateways first, while the workers still run: the requests in flight finish
        # there (or end with a clear error and [DONE]) before anything under them stops.
        gateways = [inst for inst in running if inst.role == Role.GATEWAY]
        self._stop_processes(gateways, grace)
        self._stop_processes([inst for inst in running if inst not in gateways], grace)
        for inst in list(self._procs.values()) + spares:
            inst.reap_group()
            inst.wait_output()
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        if self._nats is not None:
            self._nats.stop()
            self._nats = None
        if self._supervisor is not None:
            self._supervisor.stop()  # last: children it forked that were still alive would die with it
        if self._runtime is not None:
            self._runtime.cleanup()
            self._runtime = None
        if self._reaper is not None:
            self._reaper.close()  # last: it has nothing left to do
            self._reaper = None

    def join(self) -> None:
        """Block until the cluster is stopped (by ``stop()`` in another thread). Raises
        ClusterError if its supervisor thread fails, when nothing restarts any more."""
        if self._supervisor is None:
            return
        # In slices: a signal that lands on another thread wakes no wait, and Python runs
        # its handler (Ctrl-C's KeyboardInterrupt) only once this thread is awake.
        while not self._supervisor.ended.wait(0.25):
            pass
        if self._supervisor.error is not None:
            raise ClusterError(f"the supervisor failed: {self._supervisor.error!r}")

    def __enter__(self) -> "LocalCluster":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- for tests and for `kvserve up` --------------------------------------
    def wait_for(self, predicate: Callable[[dict[str, Heartbeat]], bool], timeout: float) -> None:
        """Return once ``predicate(heartbeats by instance id)`` holds; it is checked
        at each heartbeat. Raises TimeoutError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(dict(self._heartbeats)):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"the cluster did not reach the expected state within {timeout:g}s")
                self._cond.wait(remaining)

    def wait_for_spares(self, timeout: float) -> None:
        """Return once every worker role that keeps a warm spare has one ready (TimeoutError
        after ``timeout`` seconds); at once when this cluster keeps none."""
        if not (self.supervise and self.standby):
            return
        deadline = time.monotonic() + timeout
        for role in (r for r in STANDBY_ROLES if self.counts[r]):
            while True:
                with self._cond:
                    spare = self._spares.get(role)
                if spare is not None and spare.standby_ready.wait(max(0.0, min(0.5, deadline - time.monotonic()))):
                    break
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"no warm spare for {role} within {timeout:g}s")
                with self._cond:  # none yet (one starts STANDBY_RESPAWN_SECONDS after the last was taken)
                    self._cond.wait(0.1)

    def wait_for_exit(self, timeout: float | None = None) -> tuple[str, int] | None:
        """Block until a service process has exited: (instance id, exit code, negative
        for a signal); None when ``timeout`` passes first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                for inst in self._procs.values():
                    if (code := inst.exit_code()) is not None:
                        return inst.instance_id, code
                remaining = 1.0 if deadline is None else deadline - time.monotonic()
                if remaining <= 0:
                    return None
                # Each exit notifies; the cap only guards against an output pipe a
                # grandchild still holds open after the service itself is gone.
                self._cond.wait(min(remaining, 1.0))

    def _stop_processes(self, running: list[ServiceProcess], grace: float) -> None:
        """SIGTERM ``running``; SIGKILL those not gone ``grace`` seconds later."""
        for inst in running:
            inst.send(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for inst in running:
            try:
                inst.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.echo(f"{inst.instance_id} did not stop within {grace:g}s; killing it", label="kvserve")
                inst.proc.kill()
                inst.proc.wait()

    def kill(self, instance_id: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to one instance (for fault tests); SIGKILL returns once it is gone."""
        inst = self._instance(instance_id)
        proc = inst.proc
        inst.send(sig)
        if sig == signal.SIGKILL and proc is not None:
            proc.wait()

    def restart(self, instance_id: str) -> None:
        """Start an instance that has exited again, with the same id and environment."""
        inst = self._instance(instance_id)
        if self._supervisor is None:
            raise ClusterError("this cluster is not started")
        self._supervisor.call(self._respawn, inst, True)

    def echo(self, text: str, label: str | None = None) -> None:
        """Write ``text`` to the cluster's log, whole, between service lines."""
        self._console.echo(text, label)

    def metrics_ports(self) -> dict[str, int]:
        """Each instance's own /metrics and /healthz port: ``metrics_port`` and up, in
        the order conductor, store, prefill workers, decode workers, gateway."""
        if self.metrics_port is None:
            return {}
        ids = [self.instance_id(role, i) for role in ROLES for i in range(self.counts[role])]
        return {instance_id: self.metrics_port + n for n, instance_id in enumerate(ids)}

    # --- internals ------------------------------------------------------------
    def _make_tls(self) -> TlsFiles | None:
        """Write this host's TLS files (a leaf, its key, the CA) into the runtime directory,
        for NATS and the data plane; None where both stay plain: one host, or ``tls`` off.
        The first host makes the cluster's CA here (its key never leaves the runtime
        directory) and a leaf for itself naming its address (nats-server's routes check
        it); a joining host takes the bundle's."""
        if self.listen is None or not self.tls:
            return None
        if self.control_plane:  # its nats-server takes routes: a leaf naming its address, as the first host's
            ca = ClusterCA(self.member.tls.ca, self.member.control.ca_key)
            leaf = ca.issue(self.host_id, addresses=[self.listen])
        elif self.member is not None:
            leaf = Leaf(self.member.tls.cert, self.member.tls.key, self.member.tls.ca)
        else:
            self._ca = ClusterCA.create()
            leaf = self._ca.issue(self.host_id, addresses=[self.listen])
        return leaf.write(self.runtime_dir / "tls")

    def _bundle(self, control: bool = False) -> JoinBundle:
        """What another host needs to join this cluster (kvserve/cli/join_bundle.py); with
        ``control``, to run a control plane of its own too."""
        users = (*JOINABLE_ROLES, OBSERVER) + (CONTROL_ROLES if control else ())
        passwords = {user: load_credentials(self._nats.credentials_file(user)).password for user in users}
        tls = None
        if self._ca is not None:
            leaf = self._ca.issue("joined-host")
            tls = BundleTls(leaf.cert, leaf.key, leaf.ca)
        spec = None if self.model is None or self.model == DEFAULT_MODEL_ID else str(self.model_path)
        keys = None
        if control:
            tenants = None if self.tenants_file is None else Path(self.tenants_file).read_text()
            keys = BundleControl(
                route_ports=[server.route_port for server in self._nats.servers],
                route_password=self._nats.route_password,
                users=[BundleUser(i.role, i.instance_id, pw) for i, pw in self._nats.servers[0].users.items()],
                ca_key=None if self._ca is None else self._ca.key, api_key=self.api_key, tenants=tenants,
            )  # fmt: skip
        return JoinBundle(
            version=VERSION, host=self.listen, host_id=self.host_id,
            nats=BundleNats(ports=[server.port for server in self._nats.servers], passwords=passwords),
            model=BundleModel(spec=spec, dtype=self.dtype, quantization=self.quantization), tls=tls, control=keys,
        )  # fmt: skip

    def _take_tenants(self) -> None:
        """A control-plane host's gateway checks the first host's tenants file, as the bundle
        has it, unless this host was given its own."""
        text = self.member.control.tenants
        if self.tenants_file is None and text is not None:
            path = self.runtime_dir / "tenants.toml"
            write_private(path, text)
            self.tenants_file = str(path)

    def _resolve_model(self) -> None:
        """Prepare the model once, here, and fix the dtype every worker must share."""
        try:
            model = resolve_model(self.model, self.dtype, self.quantization, self.device)
        except ModelChoiceError as e:
            raise ClusterError(str(e)) from None
        self.model_path, self.model_id = model.path, model.model_id
        self.dtype, self.quantization = model.dtype, model.quantization

    def _plan(self, role: str, instance_id: str) -> ServiceProcess:
        env = without_secrets(os.environ)  # each gets only the secrets it uses, given below
        env.pop("KVSERVE_MODEL", None)  # only what this cluster was given
        env.update(
            PYTHONUNBUFFERED="1",
            KVSERVE_NATS_URL=self._nats.public_url,  # no secret: that is in the instance's credentials file
            KVSERVE_NATS_CREDENTIALS=str(self._nats.credentials_file(instance_id)),  # its own user
            KVSERVE_INSTANCE_ID=instance_id,
            KVSERVE_HOST_ID=self.host_id,
            # a control-plane host's own nats-server first, the first host's once it is out of reach
            KVSERVE_NATS_IN_ORDER="1" if self.control_plane else "0",
            KVSERVE_DTYPE=self.dtype,
            KVSERVE_QUANTIZATION=self.quantization,
            KVSERVE_DEVICE=self.device,
        )
        if self.model is not None and self.model != DEFAULT_MODEL_ID:
            env["KVSERVE_MODEL"] = str(self.model_path)
        if role == Role.GATEWAY and self.api_key is not None:
            env["KVSERVE_API_KEY"] = self.api_key  # the gateway alone checks it
        if role == Role.GATEWAY and self.tenants_file is not None:
            env["KVSERVE_TENANTS_FILE"] = self.tenants_file
        if role == Role.GATEWAY:
            env.update(KVSERVE_GATEWAY_HOST=self.gateway_host, KVSERVE_GATEWAY_PORT=str(self.gateway_port))
        if role in (Role.PREFILL, Role.DECODE) and self._runtime is not None:
            # a restarted worker reuses its first run's calibration (libs/engine/cost_model.py)
            env["KVSERVE_CALIBRATION_FILE"] = str(Path(self._runtime.name) / f"{instance_id}.calibration.json")
        if (tls := self._tls_files) is not None:
            env.update(KVSERVE_NATS_TLS_CERT=tls.cert, KVSERVE_NATS_TLS_KEY=tls.key, KVSERVE_NATS_TLS_CA=tls.ca)
        if role in DATA_PLANE_ROLES and self.listen is not None:
            env["KVSERVE_TRANSFER_HOST"] = self.listen  # where the other hosts' workers reach its data plane
            if tls is not None:
                env.update(KVSERVE_TRANSFER_TLS_CERT=tls.cert, KVSERVE_TRANSFER_TLS_KEY=tls.key,
                           KVSERVE_TRANSFER_TLS_CA=tls.ca)  # fmt: skip
        if role == Role.STORE and self.store_dir is not None:
            env["KVSERVE_STORE_DIR"] = str(self.store_dir / instance_id)
        if not self.counts[Role.STORE]:
            env["KVSERVE_USE_STORE"] = "0"  # prefill workers then never ask a store that is not there
        env.update(self.cpu_plan[instance_id].env())
        if self.metrics_port is not None:
            env["KVSERVE_METRICS_PORT"] = str(self.metrics_ports()[instance_id])
        env.update(self.extra_env)
        if role != Role.GATEWAY:
            env.pop("KVSERVE_API_KEY", None)  # not even from ``env``
        if "OMP_NUM_THREADS" in self.extra_env and "KVSERVE_THREADS" not in self.extra_env:
            env["KVSERVE_THREADS"] = self.extra_env["OMP_NUM_THREADS"]  # the threads asked for, not the plan's
        return ServiceProcess(instance_id, role, self.modules[role], env)

    def _spawn(self, inst: ServiceProcess) -> None:
        """Start ``inst``; on the supervisor's thread only (see die_with_launcher)."""
        prefix = self._console.prefix(inst.instance_id, inst.role)
        inst.spawn(write=lambda line: self._console.echo(prefix + line), on_exit=self._on_process_exit)
        self._tell_reaper(watch=inst.pid)  # before it can have created a segment
        with self._cond:
            self._procs[inst.instance_id] = inst

    def _on_process_exit(self, pid: int) -> None:
        """A service process has exited and its segments are removed."""
        self._tell_reaper(forget=pid)
        with self._cond:
            self._cond.notify_all()
        if self._supervisor is not None:
            self._supervisor.wake()

    def _tell_reaper(self, watch: int | None = None, forget: int | None = None) -> None:
        """Name to the watchdog a process just started (``watch``), or one that has exited
        and whose segments are removed (``forget``)."""
        reaper = self._reaper
        if reaper is None:
            return
        if forget is not None:
            reaper.forget(forget)
        if watch is not None:
            reaper.watch(watch)

    # --- supervision (on the supervisor's thread) ----------------------------
    def _watch_all(self) -> None:
        def backoff() -> Backoff:
            first, longest = self.restart_delays
            return Backoff(first=first, longest=longest)

        # A restarted gateway listens where the announced URL says, even if port 0 was asked for.
        if self.gateway_id in self._procs:  # (a joining host runs none)
            self._procs[self.gateway_id].env["KVSERVE_GATEWAY_PORT"] = str(urlsplit(self.gateway_url).port)
        for inst in self._procs.values():
            self._supervisor.watch(
                inst.instance_id,
                inst.exit_code,
                start=lambda inst=inst: self._respawn(inst, False),
                on_exit=lambda ended, inst=inst: self._on_exit(ended, inst),
                backoff=backoff(),
                started_at=inst.spawned_at,
            )
        if self.standby:
            for role in STANDBY_ROLES:
                if self.counts[role]:
                    self._supervisor.call(self._spawn_spare, role)
        for server in self._nats.servers:
            self._supervisor.watch(
                server.name,
                server.exit_code,
                start=lambda server=server: self._restart_nats(server),
                on_exit=lambda ended, server=server: self._on_exit(ended, None, server),
                backoff=backoff(),
                started_at=self._nats_started_at,
            )

    def _on_exit(self, ended: Exit, inst: ServiceProcess | None, server: NatsServer | None = None) -> None:
        """Say who died (an instance, or else nats-server ``server``), how and when it starts
        again; clear what it left behind."""
        pid = inst.pid if inst is not None else server.pid
        where = f" on port {server.port}" if inst is None else ""
        text = f"{ended.name} (pid {pid}) {describe_exit(ended.code)} after {ended.ran_for:.1f}s; "
        if ended.crash_looping:
            text += (
                f"it is crash-looping ({ended.failures} exits in a row, each within "
                f"{HEALTHY_AFTER_SECONDS:g}s of starting); "
            )
        self.echo(text + f"restarting it{where} in {ended.delay:g}s", label="kvserve")
        if ended.crash_looping and inst is not None:
            self.echo(inst.last_lines(10).lstrip("\n"))
        if inst is not None:
            inst.reap_group()
        if removed := remove_segments_of(pid):
            self.echo(f"removed {len(removed)} shared-memory segments {ended.name} left", label="kvserve")

    def _respawn(self, inst: ServiceProcess, by_hand: bool) -> None:
        if inst.exit_code() is None:
            if not by_hand:
                return  # restarted by hand (restart()) while the supervisor's restart was due
            raise ClusterError(f"{inst.instance_id} is still running")
        inst.reap_group()
        inst.wait_output()  # its last lines first, in order
        if self._adopt_spare(inst):
            self.echo(f"{inst.instance_id} started again (pid {inst.pid}, the warm spare)", label="kvserve")
            return
        self._spawn(inst)
        if not by_hand:
            self.echo(f"{inst.instance_id} started again (pid {inst.pid})", label="kvserve")

    def _spawn_spare(self, role: str) -> None:
        """Start a warm spare for ``role`` unless it has one (supervisor's thread only)."""
        if self._supervisor is None or self._nats is None or not self.supervise:
            return  # stopping
        with self._cond:
            spare = self._spares.get(role)
            if spare is not None and spare.exit_code() is None:
                return
        model_of = next(inst for inst in self._procs.values() if inst.role == role)
        spare_id = self.instance_id(role, 0).rsplit("-", 1)[0] + "-spare"  # decode-spare, decode-hostb-spare
        env = dict(model_of.env) | {standby.STANDBY_ENV: "1", "KVSERVE_INSTANCE_ID": spare_id}
        spare = ServiceProcess(spare_id, role, self.modules[role], env)
        prefix = self._console.prefix(spare.instance_id, role)
        spare.spawn(write=lambda line: self._console.echo(prefix + line), on_exit=self._on_process_exit)
        self._tell_reaper(watch=spare.pid)
        with self._cond:
            self._spares[role] = spare

    def _adopt_spare(self, inst: ServiceProcess) -> bool:
        """Start ``inst`` as its role's warm spare, if it has one; a new spare follows later."""
        if not self.standby or inst.role not in STANDBY_ROLES:
            return False
        timer = threading.Timer(STANDBY_RESPAWN_SECONDS, self._respawn_spare_later, args=(inst.role,))
        timer.daemon = True
        self._spare_timers = [t for t in self._spare_timers if t.is_alive()] + [timer]  # one per restart, not forever
        timer.start()
        with self._cond:
            spare = self._spares.get(inst.role)
            if spare is None or spare.exit_code() is not None:
                return False  # none, or dead: start the instance the slow way
            # one still loading is adopted too: it reads its assignment once loaded, ahead of a new process
            del self._spares[inst.role]
        prefix = self._console.prefix(inst.instance_id, inst.role)
        try:
            inst.adopt(spare, write=lambda line: self._console.echo(prefix + line))
        except OSError:  # it died just now
            return False
        return True

    def _respawn_spare_later(self, role: str) -> None:
        supervisor = self._supervisor
        if supervisor is None:
            return
        try:
            supervisor.call(self._spawn_spare, role)
        except RuntimeError:  # the supervisor has ended: the cluster is stopping
            pass
        except OSError as e:
            self.echo(f"could not start a warm spare for {role}: {e}", label="kvserve")

    def _restart_nats(self, server: NatsServer) -> None:
        self._tell_reaper(forget=server.pid)  # it has exited; it creates no segment
        server.restart()
        self._tell_reaper(watch=server.pid)
        self.echo(f"{server.name} started again on {server.public_url} (pid {server.pid})", label="kvserve")

    def _on_heartbeat(self, beat: Heartbeat) -> None:
        with self._cond:
            self._heartbeats[beat.instance_id] = beat
            self._last_seen[beat.instance_id] = time.monotonic()
            self._cond.notify_all()

    def _wait_ready(self, deadline: float, timeout: float) -> None:
        with self._cond:
            while True:
                dead = next((inst for inst in self._procs.values() if inst.exit_code() is not None), None)
                if dead is not None:
                    break
                heard_all = self._procs.keys() <= self._heartbeats.keys()
                if not self.counts[Role.GATEWAY] and heard_all:
                    return  # a joining host: the first host's gateway serves
                gateway = self._heartbeats.get(self.gateway_id)
                if gateway is not None and gateway.address and heard_all:
                    self.gateway_url = _base_url(gateway.address)
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ClusterError(self._not_ready(timeout))
                self._cond.wait(min(remaining, 1.0))  # the cap: see wait_for_exit
        dead.wait_output()  # its last lines, which say why
        raise ClusterError(
            f"{dead.instance_id} {describe_exit(dead.exit_code())} before the cluster was ready"
            + dead.last_lines()
        )

    def _not_ready(self, timeout: float) -> str:
        silent = [inst for i, inst in self._procs.items() if i not in self._heartbeats]
        if not silent and self.gateway_id in self._procs:
            gateway = self._procs[self.gateway_id]
            return f"{self.gateway_id} did not report its address within {timeout:g}s" + gateway.last_lines()
        names = ", ".join(inst.instance_id for inst in silent)
        return f"no heartbeat from {names} within {timeout:g}s" + "".join(inst.last_lines() for inst in silent)

    def exit_codes(self) -> dict[str, int | None]:
        """Each service's exit code; None while it runs."""
        return {i: inst.exit_code() for i, inst in self._procs.items()}

    def _instance(self, instance_id: str) -> ServiceProcess:
        try:
            return self._procs[instance_id]
        except KeyError:
            raise ClusterError(f"no instance {instance_id!r}; this cluster runs {', '.join(self._procs)}") from None


def instance_tag(host_id: str) -> str:
    """``host_id`` as it goes into an instance id, which must be one NATS subject token:
    letters, digits, - and _ kept, the rest (a domain name's dots) as -."""
    return "".join(c if c.isascii() and (c.isalnum() or c in "-_") else "-" for c in host_id).strip("-") or "host"


def _base_url(address: str) -> str:
    """The gateway's base URL, without a trailing slash or /v1."""
    url = address.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url
