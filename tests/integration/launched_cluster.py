"""A supervised local cluster of the real services, as `kvserve up` runs it, until it is
killed: for the test that kills its launcher mid-stream. ``python -m
tests.integration.launched_cluster`` prints ``cluster {"url": <gateway URL>, "pids":
{"<instance id>": pid, ..., "nats-server": pid, "reaper": pid}}`` once the cluster is ready."""

import json
import tempfile

from kvserve.cli.cluster import LocalCluster
from tests.integration.conftest import CLUSTER_ENV


def main() -> None:
    cluster = LocalCluster(gateway_port=0, dtype="float32", env=CLUSTER_ENV, log=None, supervise=True,
                           store_dir=tempfile.mkdtemp(prefix="kvserve-stores-"))  # fmt: skip
    cluster.start(timeout=120)
    pids = cluster.pids | {"nats-server": cluster.nats_pid, "reaper": cluster.reaper_pid}
    print("cluster " + json.dumps({"url": cluster.gateway_url, "pids": pids}), flush=True)
    cluster.join()


if __name__ == "__main__":
    main()
