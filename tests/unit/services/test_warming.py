"""Start-up work that runs beside requests is announced: while it runs, heartbeats say
``warming`` and a prefill worker takes no sample of its speed; the conductor learns no
speed or margin from what ran then (tests/unit/conductor/test_margin.py)."""

import asyncio
import threading

from libs.common.service import Service
from libs.common.settings import ServiceSettings
from services.prefill.worker import MIN_SPEED_STEPS, StepSpeed


async def test_heartbeats_say_warming_while_the_start_up_work_runs_and_after_it_fails():
    service = Service(ServiceSettings(role="prefill", nats_url="nats://127.0.0.1:1", instance_id="prefill-w",
                                      host_id="h"))  # fmt: skip
    assert not service.heartbeat().warming
    release = threading.Event()
    task = service.warm_in_background(release.wait)
    assert service.heartbeat().warming
    release.set()
    await task
    assert not service.heartbeat().warming

    def broken() -> None:
        raise ImportError("no such library")

    failed = service.warm_in_background(broken)
    assert service.heartbeat().warming
    await asyncio.wait([failed])
    assert not service.heartbeat().warming  # failing ends it too: a worker is never warming forever


def test_a_workers_speed_is_unknown_until_it_has_enough_steps():
    speed = StepSpeed()
    speed.observe(seconds=5.0, predicted=1.0)  # the first step: a shape not seen yet
    for _ in range(MIN_SPEED_STEPS - 2):
        assert speed.value == 0.0
        speed.observe(seconds=1.1, predicted=1.0)
    assert speed.value == 0.0
    speed.observe(seconds=1.1, predicted=1.0)
    assert speed.value == 1.1  # the median: the outlier does not move it
    speed.observe(seconds=3.0, predicted=0.0)  # predicts nothing: ignored
    assert len(speed.ratios) == MIN_SPEED_STEPS
