"""Runs one service instance inside another network namespace (another "host").

LocalCluster runs ``python -m tests.reliability.in_netns`` for a role; this reads the
instance id and ``KVSERVE_TEST_NETNS_PLAN`` (JSON: instance id -> {"netns", "host_id",
"transfer_host"}) and replaces itself with ``services.<role>`` — inside ``ip netns
exec`` with that host's id and transfer address for a planned instance, here for the
others. exec keeps the process (and its parent-death signal), so the launcher still
supervises it as its own child.
"""

import json
import os
import sys


def main() -> None:
    instance_id = os.environ["KVSERVE_INSTANCE_ID"]
    role = instance_id.rsplit("-", 1)[0]
    command = [sys.executable, "-m", f"services.{role}"]
    plan = json.loads(os.environ.get("KVSERVE_TEST_NETNS_PLAN", "{}")).get(instance_id)
    if plan is None:
        os.execv(sys.executable, command)
    env = dict(os.environ, KVSERVE_HOST_ID=plan["host_id"], KVSERVE_TRANSFER_HOST=plan["transfer_host"])
    os.execvpe("ip", ["ip", "netns", "exec", plan["netns"], *command], env)


if __name__ == "__main__":
    main()
