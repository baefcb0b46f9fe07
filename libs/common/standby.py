"""A warm spare: a worker process started before it is needed, which imports its code and
loads the model, then waits for the launcher to say which instance it is.

A supervisor that keeps one per role (kvserve/cli/cluster.py) restarts a dead worker by
handing its instance's environment to the spare, so the restart skips the interpreter's
start, torch's import and the model's load (about 4 s of a 2-core machine's time, during
which the dead worker's streams wait). The handshake is one JSON line on the spare's
standard input: the instance's whole environment. End of input means it is not needed.
"""

import json
import os
import sys
from collections.abc import Callable

STANDBY_ENV = "KVSERVE_STANDBY"  # "1": start as a spare
READY_LINE = "kvserve-standby: ready"  # written on standard output once the model is loaded


class AssignmentError(ValueError):
    """What the launcher sent is not an environment."""


def requested() -> bool:
    return os.environ.get(STANDBY_ENV) == "1"


def parse_assignment(line: str) -> dict[str, str]:
    """The environment in one line of JSON: an object of strings."""
    try:
        env = json.loads(line)
    except ValueError as e:
        raise AssignmentError(f"not JSON: {e}") from None
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise AssignmentError("not an object of strings")
    if env.get(STANDBY_ENV) == "1":
        raise AssignmentError(f"an assignment cannot be another spare ({STANDBY_ENV}=1)")
    return env


def wait_for_assignment(preload: Callable[[], None]) -> None:
    """Run ``preload``, say so, and block until the launcher sends an instance's environment,
    which then replaces this process's own. Exits with 0 if none comes (end of input)."""
    preload()
    print(READY_LINE, flush=True)
    line = sys.stdin.readline()
    if not line:
        sys.exit(0)
    try:
        env = parse_assignment(line)
    except AssignmentError as e:
        print(f"standby: bad assignment from the launcher: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    os.environ.clear()
    os.environ.update(env)
