"""Named fault-injection points, for reliability tests of real processes.

``KVSERVE_FAILPOINTS`` lists ``name`` or ``instance_id:name`` entries, comma
separated; a failpoint is active in a process when its name is listed bare or
with the process's ``KVSERVE_INSTANCE_ID``. Unset (always, in production),
every check is one frozenset lookup.

Failpoints: ``transfer.stall_receive`` — the TCP listener accepts a transfer's
token, then stops reading (a hung peer); ``transfer.stall_first_receive`` — the
same for the first transfer only (a hand-off caught mid-way, later ones normal). ``store.stall_disk_write`` — the store
writes a block file's header and half its payload to the temp file, fsyncs it,
then blocks forever (a crash mid-write, once the process is killed).
``prefill.stall_before_compute`` — a prefill worker acknowledges requests, then
never computes them (a hung worker that still sends heartbeats).
``conductor.stall_admit`` — a conductor takes admission requests and never answers
them (a replica that dies holding requests, once the process is killed).
"""

import threading

from libs.common.settings import ProcessSettings
from libs.protocol.ids import InstanceId


def parse(spec: str, instance_id: InstanceId | None) -> frozenset[str]:
    """The failpoints ``spec`` arms in the process ``instance_id`` (None: a process without one)."""
    active = set()
    for entry in spec.split(","):
        entry = entry.strip()
        if not entry:
            continue
        target, _, name = entry.rpartition(":")
        if not target or target == instance_id:
            active.add(name)
    return frozenset(active)


_SETTINGS = ProcessSettings.from_env()
_ACTIVE = parse(_SETTINGS.failpoints, _SETTINGS.instance_id)


_FIRED: set[str] = set()
_FIRED_LOCK = threading.Lock()


def active(name: str) -> bool:
    return name in _ACTIVE


def first_time(name: str) -> bool:
    """True for the first check of an active failpoint in this process, False after and when inactive."""
    if name not in _ACTIVE:
        return False
    with _FIRED_LOCK:
        if name in _FIRED:
            return False
        _FIRED.add(name)
        return True
