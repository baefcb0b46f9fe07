"""SIGTERM ends a service with exit status 0 and no traceback whatever NATS is doing:
up, gone after the service connected (uvloop once refused to close the dead
connection and the process exited 1), or never reached."""

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from libs.common.nats_server import NatsServer

WAIT = 30.0  # seconds any single expected event may take
ROOT = Path(__file__).resolve().parents[3]
SERVICE = """
import sys
from libs.common.service import Service, configure_logging, run_service
from libs.common.settings import ServiceSettings
configure_logging("store-x")
run_service(Service(ServiceSettings(role="store", nats_url=sys.argv[1], instance_id="store-x", host_id="h")))
"""


class ServiceProcess:
    """A bare Service in its own process (run_service: uvloop when installed), its log read line by line."""

    def __init__(self, nats_url: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, "-c", SERVICE, nats_url], stderr=subprocess.PIPE, text=True,
                                     env=env, cwd=ROOT)  # fmt: skip
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.put(line)

    def wait_for(self, text: str) -> None:
        deadline = time.monotonic() + WAIT
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            self.log.append(line)
            if text in line:
                return
        raise AssertionError(f"no log line with {text!r} within {WAIT}s; the log:\n{''.join(self.log)}")

    def terminate(self) -> tuple[int, str]:
        """SIGTERM; the exit status and the whole log."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(WAIT)
        finally:
            self.proc.kill()  # a no-op once it exited
        self.reader.join(WAIT)  # its log ends where the process did
        while not self.lines.empty():
            self.log.append(self.lines.get())
        return code, "".join(self.log)


@pytest.fixture
def nats_server():
    with NatsServer() as server:
        yield server


def unused_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"nats://127.0.0.1:{s.getsockname()[1]}"


def test_sigterm_with_nats_up_exits_zero(nats_server):
    service = ServiceProcess(nats_server.url)
    service.wait_for("store-x ready")
    code, log = service.terminate()
    assert (code, "Traceback" in log) == (0, False), log


def test_sigterm_after_nats_went_down_exits_zero(nats_server):
    service = ServiceProcess(nats_server.url)
    service.wait_for("store-x ready")
    nats_server.stop()
    service.wait_for("disconnected from NATS")
    code, log = service.terminate()
    assert (code, "Traceback" in log) == (0, False), log


def test_sigterm_before_nats_was_ever_reached_exits_zero():
    service = ServiceProcess(unused_url())
    service.wait_for("retrying")
    code, log = service.terminate()
    assert (code, "Traceback" in log) == (0, False), log
