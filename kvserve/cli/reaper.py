"""What a local cluster leaves on the machine is removed when its launcher dies, however
it dies (kill -9 included): its processes' shared-memory segments and its runtime
directory (the NATS credentials, nats-server's configuration, workers' calibrations).

Its processes die with the launcher (kvserve/cli/supervisor.py); what they leave is
removed by a watchdog, ``python -m kvserve.cli.reaper RUNTIME_DIR``, started by the
launcher in a session of its own so that nothing aimed at the launcher or its terminal
reaches it. The launcher names each process it starts on a pipe (``watch <pid>``) and
each one whose segments it removed itself after its exit (``forget <pid>``). When the
pipe ends — the launcher exited, cleanly or not — the watchdog waits for every process
still named to exit, unlinks the segments each created (``kvserve-<pid>-*``), removes
the runtime directory and exits. It holds each process as a pidfd from the moment it is
named, so a pid reused by another process, of another cluster say, is never waited on,
and it touches no segment but those of the processes named to it. Linux only.
"""

import os
import select
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterable
from pathlib import Path

from kvserve.cli.supervisor import remove_segments_of
from libs.common.settings import without_secrets

STOP_WAIT_SECONDS = 10.0  # a clean stop: every process has exited, so the watchdog is done at once


class Reaper:
    """The launcher's end of the watchdog: ``watch`` every process as soon as it is
    started, ``forget`` one once it has exited and its segments are removed, and
    ``close`` at a clean stop, once everything has exited."""

    def __init__(self, runtime_dir: Path) -> None:
        read_end, self._pipe = os.pipe()  # neither end is inherited by another child (PEP 446)
        self._lock = threading.Lock()  # the supervisor thread and the log threads tell it things
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "kvserve.cli.reaper", str(runtime_dir)],
                stdin=read_end,
                stdout=subprocess.DEVNULL,
                env=without_secrets(os.environ),
                start_new_session=True,  # no Ctrl-C or kill of the launcher's group reaches it
            )
        except BaseException:
            os.close(self._pipe)
            raise
        finally:
            os.close(read_end)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def watch(self, pid: int) -> None:
        """Clean up after process ``pid`` if the launcher dies (call right after starting it)."""
        self._tell(f"watch {pid}\n")

    def forget(self, pid: int) -> None:
        """Process ``pid`` has exited and its segments are removed: nothing is left to do for it."""
        self._tell(f"forget {pid}\n")

    def close(self) -> None:
        """End the pipe, as the launcher's death would, and wait for the watchdog to finish. Idempotent."""
        with self._lock:
            if self._pipe is None:
                return
            os.close(self._pipe)
            self._pipe = None
        try:
            self._proc.wait(STOP_WAIT_SECONDS)
        except subprocess.TimeoutExpired:
            pass  # a process it waits for is still exiting: it finishes on its own

    def _tell(self, line: str) -> None:
        with self._lock:
            if self._pipe is None:
                return
            try:
                os.write(self._pipe, line.encode())
            except OSError:
                pass  # the watchdog is gone (killed on its own): nothing to tell


def reap(lines: Iterable[bytes], runtime_dir: Path) -> None:
    """Follow the launcher's ``lines`` until they end, then clean up after every process
    still named once it has exited, and remove ``runtime_dir``."""
    named: dict[int, int | None] = {}  # pid -> its pidfd; None: it had exited before it was named
    for line in lines:
        verb, _, arg = line.decode(errors="replace").strip().partition(" ")
        if not arg.isdigit():
            continue
        pid = int(arg)
        if verb == "watch" and pid not in named:
            named[pid] = _pidfd(pid)
        elif verb == "forget" and pid in named:
            if (pidfd := named.pop(pid)) is not None:
                os.close(pidfd)
    for pid, pidfd in named.items():
        if pidfd is not None:
            select.select([pidfd], [], [])  # readable once the process has exited
            os.close(pidfd)
        remove_segments_of(pid)
    shutil.rmtree(runtime_dir, ignore_errors=True)


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return None


def main() -> None:
    reap(sys.stdin.buffer, Path(sys.argv[1]))


if __name__ == "__main__":
    main()
