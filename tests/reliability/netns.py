"""A second "host" on this machine: a network namespace joined to this one by a veth pair.

Needs root (CI runs as root); `available()` says why not where it cannot be made.
The addresses are the namespaces' own (10.250.N.1 here, 10.250.N.2 there): traffic
between them never leaves the machine.
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
class SecondHost:
    """``netns`` is the other host; ``local_address`` is this host's end of the link,
    ``remote_address`` the other's. ``cut()`` and ``restore()`` take the link down and up."""

    netns: str
    local_link: str
    local_address: str
    remote_address: str

    @classmethod
    def create(cls) -> "SecondHost":
        tag = secrets.token_hex(3)
        subnet = 200 + secrets.randbelow(50)
        host = cls(f"kvt-{tag}", f"kvt-{tag}-a", f"10.250.{subnet}.1", f"10.250.{subnet}.2")
        peer_link = f"kvt-{tag}-b"
        try:
            for command in (
                ["ip", "netns", "add", host.netns],
                ["ip", "link", "add", host.local_link, "type", "veth", "peer", "name", peer_link],
                ["ip", "link", "set", peer_link, "netns", host.netns],
                ["ip", "addr", "add", f"{host.local_address}/24", "dev", host.local_link],
                ["ip", "-n", host.netns, "addr", "add", f"{host.remote_address}/24", "dev", peer_link],
                ["ip", "link", "set", host.local_link, "up"],
                ["ip", "-n", host.netns, "link", "set", peer_link, "up"],
                ["ip", "-n", host.netns, "link", "set", "lo", "up"],
            ):
                subprocess.run(command, check=True, capture_output=True, text=True)
        except BaseException:
            host.remove()
            raise
        return host

    def cut(self) -> None:
        subprocess.run(["ip", "link", "set", self.local_link, "down"], check=True, capture_output=True)

    def restore(self) -> None:
        subprocess.run(["ip", "link", "set", self.local_link, "up"], check=True, capture_output=True)

    def remove(self) -> None:
        subprocess.run(["ip", "link", "del", self.local_link], capture_output=True)  # takes its peer with it
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True)
