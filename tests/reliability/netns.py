"""Other "hosts" on this machine: network namespaces on a bridge in this one.

Needs root (CI runs as root); `available()` says why not where it cannot be made.
The addresses are the namespaces' own (10.250.N.1 here, 10.250.N.2 and up there):
traffic between them never leaves the machine.
"""

import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass


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
