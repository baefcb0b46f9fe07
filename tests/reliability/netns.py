"""Other "hosts" on this machine: network namespaces on a bridge in this one, and the
kvserve commands they run (`HostProcess`).

Needs root (CI runs as root); `available()` says why not where it cannot be made.
The addresses are the namespaces' own (10.250.N.1 here, 10.250.N.2 and up there):
traffic between them never leaves the machine.
"""

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvserve.cli.supervisor import die_with_launcher
from tests.integration.conftest import wait_until


def available() -> str | None:
    """None when a namespace can be made here; otherwise why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"kvt-probe-{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@dataclass
class Network:
    """Hosts on one link: a bridge in this network namespace (this host, ``address``) and
    one namespace per other host (``hosts[i]``, at ``addresses[i]``), each joined to the
    bridge by a veth pair, so every host reaches every other directly. ``cut(i)`` and
    ``restore(i)`` take host i's link down and up."""

    bridge: str
    address: str
    hosts: list[str]  # the namespaces
    addresses: list[str]
    links: list[str]  # each host's end of its veth pair on this side, on the bridge

    @classmethod
    def create(cls, num_hosts: int) -> "Network":
        tag = secrets.token_hex(3)
        subnet = f"10.250.{200 + secrets.randbelow(50)}"
        net = cls(f"kvt-{tag}", f"{subnet}.1", [f"kvt-{tag}-{i}" for i in range(num_hosts)],
                  [f"{subnet}.{i + 2}" for i in range(num_hosts)], [f"kvt-{tag}-{i}a" for i in range(num_hosts)])  # fmt: skip
        commands = [
            ["ip", "link", "add", net.bridge, "type", "bridge"],
            ["ip", "addr", "add", f"{net.address}/24", "dev", net.bridge],
            ["ip", "link", "set", net.bridge, "up"],
        ]
        for host, address, link in zip(net.hosts, net.addresses, net.links):
            peer = link[:-1] + "b"
            commands += [
                ["ip", "netns", "add", host],
                ["ip", "link", "add", link, "type", "veth", "peer", "name", peer],
                ["ip", "link", "set", peer, "netns", host],
                ["ip", "link", "set", link, "master", net.bridge],
                ["ip", "-n", host, "addr", "add", f"{address}/24", "dev", peer],
                ["ip", "link", "set", link, "up"],
                ["ip", "-n", host, "link", "set", peer, "up"],
                ["ip", "-n", host, "link", "set", "lo", "up"],
            ]
        try:
            for command in commands:
                subprocess.run(command, check=True, capture_output=True, text=True)
        except BaseException:
            net.remove()
            raise
        return net

    def cut(self, i: int) -> None:
        subprocess.run(["ip", "link", "set", self.links[i], "down"], check=True, capture_output=True)

    def restore(self, i: int) -> None:
        subprocess.run(["ip", "link", "set", self.links[i], "up"], check=True, capture_output=True)

    def remove(self) -> None:
        for link, host in zip(self.links, self.hosts):
            subprocess.run(["ip", "link", "del", link], capture_output=True)  # takes its peer with it
            subprocess.run(["ip", "netns", "del", host], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


class HostProcess:
    """A kvserve command (``args``) run in network namespace ``netns_name``, its output in ``log``."""

    def __init__(self, netns_name: str, args: list[str], log: Path, env: dict[str, str]) -> None:
        self.log = log
        command = [str(Path(sys.executable).parent / "kvserve"), *args]
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", netns_name, *command], stdout=log.open("wb"), stderr=subprocess.STDOUT,
            env={**os.environ, **env}, preexec_fn=die_with_launcher(),
        )  # fmt: skip

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        """The first match of ``pattern`` in its output, once there (fails the test if it exits first,
        or after ``timeout`` seconds)."""
        found: list[re.Match] = []

        def seen() -> bool:
            if match := re.search(pattern, self.output()):
                found.append(match)
                return True
            if self.proc.poll() is not None:
                pytest.fail(f"{self.log.name}: exited with {self.proc.returncode}:\n{self.output()[-3000:]}")
            return False

        try:
            wait_until(seen, timeout)
        except (AssertionError, TimeoutError):
            pytest.fail(f"{self.log.name}: no {pattern!r} within {timeout:g} s:\n{self.output()[-3000:]}")
        return found[0]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # as Ctrl-C: its services drain
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
