"""A real cluster shares the host's cores: each worker process runs pinned to the cores
its plan gave it, with as many torch threads, and OpenMP threads that sleep when idle."""

import os
import re
from pathlib import Path

from libs.common.cpu_share import format_cpu_list
from tests.integration.conftest import start_cluster


def _status(pid: int, field: str) -> str:
    line = next(l for l in Path(f"/proc/{pid}/status").read_text().splitlines() if l.startswith(field + ":"))
    return line.split(":", 1)[1].strip()


def test_each_worker_runs_on_its_own_cores_with_one_thread_per_core():
    cluster = start_cluster(prefill=1, decode=1)
    try:
        host = os.sched_getaffinity(0)
        shares = {i: cluster.cpu_plan[i] for i in ("prefill-0", "decode-0")}
        if len(host) >= 2:
            assert set(shares["prefill-0"].cpus).isdisjoint(shares["decode-0"].cpus)
        for instance_id, share in shares.items():
            pid = cluster.pids[instance_id]
            assert os.sched_getaffinity(pid) == set(share.cpus)
            assert _status(pid, "Cpus_allowed_list") == format_cpu_list(share.cpus)
            # every thread, the engine's and OpenMP's included, not only the main one
            for task in Path(f"/proc/{pid}/task").iterdir():
                assert os.sched_getaffinity(int(task.name)) == set(share.cpus)
            said = [l for l in cluster.logs(instance_id) if f"{instance_id} runs on cores" in l]
            assert said, cluster.logs(instance_id)
            match = re.search(r"runs on cores (\S+), torch threads: (\d+)", said[0])
            assert match.groups() == (format_cpu_list(share.cpus), str(share.threads))
            assert share.threads == len(share.cpus)
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert b"GOMP_SPINCOUNT=1000" in environ
        gateway = cluster.pids["gateway-0"]
        assert os.sched_getaffinity(gateway) == host  # the I/O processes are not pinned
    finally:
        cluster.stop()
