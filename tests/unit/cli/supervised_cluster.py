"""A supervised LocalCluster of stand-in services (fake_service.py), run until it is
killed, for the test that kills its launcher: ``python -m tests.unit.cli.supervised_cluster
MODEL_DIR`` prints two lines once the cluster is ready: ``pids {"<instance id>": pid, ...,
"nats-server": pid, "reaper": pid}`` and ``runtime <its runtime directory>``."""

import json
import sys

from tests.unit.cli.harness import make_cluster


def main() -> None:
    cluster = make_cluster(sys.argv[1], log=None, supervise=True, env={"KVSERVE_FAKE_SEGMENT": "1"})
    cluster.start(timeout=60)
    print("pids " + json.dumps(cluster.pids | {"nats-server": cluster.nats_pid, "reaper": cluster.reaper_pid}))
    print(f"runtime {cluster.runtime_dir}", flush=True)
    cluster.join()


if __name__ == "__main__":
    main()
