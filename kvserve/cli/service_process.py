"""One service instance as a child process of the launcher: what it runs (module and
environment), its process, and the thread that hands its output on, line by line,
keeping the last lines to say why it died. A warm spare (libs/common/standby.py) is one
too, until an instance adopts its process."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.cli.supervisor import die_with_launcher, remove_segments_of
from libs.common import standby
from libs.protocol.vocabulary import Role

LOG_TAIL_LINES = 200


@dataclass
class ServiceProcess:
    instance_id: str
    role: str
    module: str
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    reader: threading.Thread | None = None
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=LOG_TAIL_LINES))
    spawned_at: float = 0.0  # time.monotonic() of the last start
    standby_ready: threading.Event = field(default_factory=threading.Event)  # a spare: its model is loaded
    _write: Callable[[str], None] = print

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    @property
    def is_standby(self) -> bool:
        return self.env.get(standby.STANDBY_ENV) == "1"

    def spawn(self, write: Callable[[str], None], on_exit: Callable[[int], None]) -> None:
        """Start it, on the thread that forks every child (see die_with_launcher); each
        line it writes goes to ``write``; ``on_exit(pid)`` once it has exited, its output
        ended and its segments are removed. A spare reads its assignment from a pipe."""
        self.spawned_at = time.monotonic()
        self.standby_ready.clear()
        self._write = write
        self.proc = subprocess.Popen(
            [sys.executable, "-m", self.module],
            env=self.env,
            stdin=subprocess.PIPE if self.is_standby else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            # Its own process group: a Ctrl-C in the terminal reaches the launcher
            # only, which then stops the services in order instead of all at once.
            start_new_session=True,
            # The gateway outlives a killed launcher by its drain: its streams end with [DONE]
            preexec_fn=die_with_launcher(signal.SIGTERM if self.role == Role.GATEWAY else signal.SIGKILL),
        )
        self.reader = threading.Thread(
            target=self._pump, args=(self.proc, on_exit), name=f"log-{self.instance_id}", daemon=True
        )
        self.reader.start()

    def adopt(self, spare: "ServiceProcess", write: Callable[[str], None]) -> None:
        """Become ``spare``'s process: send it this instance's environment (it reads it once its
        model is loaded); from now on its lines go to ``write`` and this instance's tail."""
        assert spare.is_standby and spare.proc is not None
        spare.tail, spare._write = self.tail, write
        spare.proc.stdin.write(json.dumps(self.env).encode() + b"\n")
        spare.proc.stdin.close()
        self.proc, self.reader, self._write = spare.proc, spare.reader, write
        self.spawned_at = time.monotonic()

    def _pump(self, proc: subprocess.Popen, on_exit: Callable[[int], None]) -> None:
        for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip("\r\n")
            if line == standby.READY_LINE:
                self.standby_ready.set()
                continue
            self.tail.append(line)
            self._write(line)
        proc.stdout.close()
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait()
        remove_segments_of(proc.pid)  # what SIGKILL left it no chance to remove
        on_exit(proc.pid)

    def send(self, sig: int) -> None:
        """Send ``sig`` if it is running."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def wait_output(self, timeout: float = 5.0) -> None:
        """Wait for its last lines to be handed on (it has exited)."""
        if self.reader is not None:
            self.reader.join(timeout=timeout)

    def reap_group(self) -> None:
        """Kill whatever it left behind in its process group (it has exited)."""
        if self.proc is None or self.proc.poll() is None:
            return
        try:
            # The leader is reaped, but Linux keeps its pid from being reused while
            # its group has members, so this reaches only the leftovers.
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def last_lines(self, lines: int = 40) -> str:
        """Its last ``lines`` lines, headed by its name, for an error or a warning."""
        tail = list(self.tail)[-lines:]
        if not tail:
            return f"\n--- {self.instance_id} wrote nothing ---"
        return f"\n--- last lines of {self.instance_id} ---\n" + "\n".join(tail)


def describe_exit(code: int | None) -> str:
    if code is None:
        return "is running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
