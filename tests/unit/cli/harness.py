"""What LocalCluster's tests share: a cluster of stand-in services (fake_service.py) on
a real nats-server, and a look at which processes are alive."""

import io
import os
import signal
import subprocess
from collections.abc import Iterable
from pathlib import Path

from kvserve.cli.cluster import ROLES, LocalCluster

ROOT = Path(__file__).resolve().parents[3]
FAKE = "tests.unit.cli.fake_service"
MODULES = {role: FAKE for role in ROLES}
TINY_CONFIG = {  # enough of a config.json for the dtype choice; no weights needed
    "model_type": "llama", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 160,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
}  # fmt: skip


def make_cluster(model_dir: Path, log: io.StringIO | None, **kwargs) -> LocalCluster:
    env = {"PYTHONPATH": str(ROOT), **kwargs.pop("env", {})}
    options = dict(model=str(model_dir), dtype="float32", gateway_port=0, log=log, modules=MODULES, env=env)
    return LocalCluster(**(options | kwargs))


def children() -> set[int]:
    """Live processes whose parent is this test process (Linux /proc); compare with a
    set taken before, since a module's shared cluster runs alongside."""
    me, found = os.getpid(), set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # it exited while we looked
        if int(fields[1]) == me and fields[0] != "Z":
            found.add(int(stat.parent.name))
    return found


def kill_leftovers(launcher: subprocess.Popen, pids: Iterable[int]) -> None:
    """After a test of a launcher: kill it if it still runs, and SIGKILL any of ``pids`` still
    alive (only when the test failed: leave no orphan behind)."""
    if launcher.poll() is None:
        launcher.kill()
        launcher.wait()
    for pid in pids:
        if is_alive(pid):
            os.kill(pid, signal.SIGKILL)


def is_alive(pid: int) -> bool:
    """Running: a zombie (exited, not yet reaped by whoever adopted it) counts as gone."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
