"""A service whose essential task fails (an engine loop, an expiry loop) stops and exits
non-zero, so that its supervisor starts it again, instead of living on without its work;
a failing ordinary task is logged and the service goes on."""

import asyncio
import logging
import subprocess
import sys
import textwrap

import pytest

from libs.common.nats_server import NatsServer
from libs.common.service import EXIT_FAILED, Service
from libs.common.settings import ServiceSettings

WAIT = 30.0  # seconds a run may take at most


class Failing(Service):
    def __init__(self, settings: ServiceSettings, essential: bool) -> None:
        super().__init__(settings)
        self.essential = essential
        self.started = asyncio.Event()
        self.task: asyncio.Task | None = None

    async def start(self, stack) -> None:
        self.task = self.spawn(self._fail(), essential=self.essential)
        self.started.set()

    async def _fail(self) -> None:
        raise RuntimeError("the loop broke")


@pytest.fixture(scope="module")
def nats_server():
    with NatsServer() as server:
        yield server


def settings(url: str) -> ServiceSettings:
    return ServiceSettings(role="store", nats_url=url, instance_id="store-e", host_id="h")


async def test_an_essential_task_failing_stops_the_service(nats_server, caplog):
    service = Failing(settings(nats_server.url), essential=True)
    with caplog.at_level(logging.CRITICAL):
        await asyncio.wait_for(service.run(), WAIT)  # returns: it stopped by itself
    assert service.failed
    assert any("_fail failed: stopping" in r.getMessage() for r in caplog.records)


async def test_an_ordinary_task_failing_is_logged_and_the_service_goes_on(nats_server):
    service = Failing(settings(nats_server.url), essential=False)
    running = asyncio.create_task(service.run())
    try:
        await asyncio.wait_for(service.started.wait(), WAIT)
        await asyncio.wait([service.task])  # spawn's done-callback, registered first, has run
        assert service.task.exception() is not None
        assert not service.failed and not service.stopping.is_set() and not running.done()
    finally:
        service.stopping.set()
        await asyncio.wait_for(running, WAIT)


def test_the_process_exits_with_its_own_code(nats_server):
    script = textwrap.dedent(f"""
        from libs.common.service import run_service
        from tests.unit.services.test_essential_tasks import Failing, settings
        run_service(Failing(settings({nats_server.url!r}), essential=True))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=WAIT)
    assert done.returncode == EXIT_FAILED, done.stderr[-2000:]
    assert "RuntimeError: the loop broke" in done.stderr
