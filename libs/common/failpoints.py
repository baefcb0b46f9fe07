"""Named fault-injection points, for reliability tests of real processes.

``KVSERVE_FAILPOINTS`` lists ``name`` or ``instance_id:name`` entries, comma
separated; a failpoint is active in a process when its name is listed bare or
with the process's ``KVSERVE_INSTANCE_ID``. Unset (always, in production),
every check is one frozenset lookup.

Failpoints: ``transfer.stall_receive`` — the TCP listener accepts a transfer's
token, then stops reading (a hung peer). ``store.stall_disk_write`` — the store
writes a block file's header and half its payload to the temp file, fsyncs it,
then blocks forever (a crash mid-write, once the process is killed).
``prefill.stall_before_compute`` — a prefill worker acknowledges requests, then
never computes them (a hung worker that still sends heartbeats).
"""

import os


def _parse() -> frozenset[str]:
    instance = os.environ.get("KVSERVE_INSTANCE_ID", "")
    active = set()
    for entry in os.environ.get("KVSERVE_FAILPOINTS", "").split(","):
        entry = entry.strip()
        if not entry:
            continue
        target, _, name = entry.rpartition(":")
        if not target or target == instance:
            active.add(name)
    return frozenset(active)


_ACTIVE = _parse()


def active(name: str) -> bool:
    return name in _ACTIVE
