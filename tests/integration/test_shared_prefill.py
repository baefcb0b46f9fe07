"""A prefill worker on the decode worker's cores at low priority (`kvserve up`'s third
worker where prefill and decode have cores of their own): its engine thread alone runs
at nice 5, it never reports itself faster than its share of a busy core, and it takes
requests when the other prefill worker has a queue."""

import asyncio
import os
import random
import tempfile
from pathlib import Path

import aiohttp
import pytest

from kvserve.cli.cluster import LocalCluster
from libs.common.cpu_share import LOW_PRIORITY_NICE, LOW_PRIORITY_SHARE
from tests.conftest import make_tiny_checkpoint
from tests.integration.conftest import CLUSTER_ENV, STARTED, metric_value, metrics_of


def nice(pid: int) -> list[int]:
    """The nice value of each thread of ``pid``."""
    return [os.getpriority(os.PRIO_PROCESS, int(task.name)) for task in Path(f"/proc/{pid}/task").iterdir()]


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory):
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), max_position_embeddings=1024)
    # calibrated: the conductor routes by each prefill worker's measured speed
    env = {**CLUSTER_ENV, "KVSERVE_CALIBRATE": "1", "KVSERVE_NUM_BLOCKS": "1024"}
    cluster = LocalCluster(prefill=1, decode=1, shared_prefill=1, gateway_port=0, log=None, env=env, model=str(folder),
                           dtype="float32", store_dir=tempfile.mkdtemp(prefix="kvserve-stores-"))  # fmt: skip
    STARTED.append(cluster)
    cluster.start(timeout=120)
    yield cluster
    cluster.stop()


def test_only_the_shared_prefill_worker_s_engine_thread_yields_its_cores(shared_cluster):
    plan = shared_cluster.cpu_plan
    assert plan["prefill-1"].low_priority and plan["prefill-1"].cpus == plan["decode-0"].cpus
    assert not plan["prefill-0"].low_priority and not plan["decode-0"].low_priority
    low = nice(shared_cluster.pids["prefill-1"])
    assert low.count(LOW_PRIORITY_NICE) == 1, low  # the engine thread (it calibrated): not its event loop
    for other in ("prefill-0", "decode-0", "gateway-0"):
        assert LOW_PRIORITY_NICE not in nice(shared_cluster.pids[other]), other
    # what the conductor hears: never more than its share of a busy core
    assert shared_cluster.instances["prefill-1"].prefill_speed >= 1 / LOW_PRIORITY_SHARE
    assert shared_cluster.instances["prefill-0"].prefill_speed < 1 / LOW_PRIORITY_SHARE


def test_both_prefill_workers_serve(shared_cluster):
    cluster, rng = shared_cluster, random.Random(5)
    prompts = [[rng.randrange(0, 256) for _ in range(rng.randrange(200, 400))] for _ in range(24)]

    async def run() -> list[int]:
        async with aiohttp.ClientSession() as session:

            async def complete(prompt: list[int]) -> int:
                body = {"model": cluster.model_id, "prompt": prompt, "max_tokens": 4, "ignore_eos": True}
                async with session.post(cluster.gateway_url + "/v1/completions", json=body) as response:
                    await response.read()
                    return response.status

            return await asyncio.gather(*(complete(p) for p in prompts))  # at once: the queue spills to both

    assert asyncio.run(run()) == [200] * 24
    served = {i: metric_value(metrics_of(cluster, i), "kvserve_prefix_cache_queries_total")
              for i in ("prefill-0", "prefill-1")}  # fmt: skip
    assert served["prefill-1"] > 0 and served["prefill-0"] > 0, served
