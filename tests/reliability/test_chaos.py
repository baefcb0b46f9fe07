"""Chaos under load: a supervised cluster (what `kvserve up --prefill 2 --decode 2` runs)
serving 40 concurrent streams while one of its processes is killed with SIGKILL.

Every stream must end with [DONE] (normally, or with an error event), no client may
wait more than 10 s for a byte, at least 95% must complete normally, the killed
process must be serving again within 10 s, and its shared memory must be gone.
Bounded: 40 streams of at most 48 tokens per fault, every wait has a deadline.
"""

import asyncio
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import pytest
from openai import OpenAI

from kvserve.cli.cluster import LocalCluster
from kvserve.cli.cpus import default_shared_prefill
from kvserve.replay.streams import ChatLoad, run_streams, tally
from libs.common.cpu_share import available_cpus
from tests.integration.conftest import CLUSTER_ENV, STARTED, poll_until, wait_until

MODEL = "SmolLM2-135M-Instruct"
NUM_STREAMS = 40
MAX_TOKENS = 48
BACK_WITHIN_S = 10.0
PROMPTS = [f"Write one sentence about the number {i}." for i in range(NUM_STREAMS)]


@pytest.fixture(scope="module")
def supervised():
    cluster = LocalCluster(
        prefill=2, decode=2, gateway_port=0, dtype="auto", env=CLUSTER_ENV, log=None, supervise=True,
        store_dir=tempfile.mkdtemp(prefix="kvserve-chaos-"),
    )  # fmt: skip
    STARTED.append(cluster)
    cluster.start(timeout=180)
    cluster.wait_for_spares(timeout=120)  # as a cluster that has run a while has them
    yield cluster
    pids = set(cluster.pids.values())
    cluster.stop()
    assert _segments_of(pids) == [], "shared memory left behind by a stopped cluster"


def _segments_of(pids: set[int]) -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").glob("kvserve-*") if p.name.split("-")[1] in {str(x) for x in pids})


def _all_idle(cluster: LocalCluster):
    def idle(hbs) -> bool:
        ids = set(cluster.instance_ids)
        workers = [hb for hb in hbs.values() if hb.role in ("prefill", "decode")]
        return ids <= hbs.keys() and all(hb.load == 0 and hb.free_blocks == hb.capacity for hb in workers)

    return idle


@pytest.mark.parametrize(
    ("victim", "kill_after_first_tokens"),
    [
        ("decode", NUM_STREAMS),  # every stream is decoding: the busier decode worker is killed
        ("prefill-1", 8),  # most prompts are still queued for prefill, half of them on prefill-1
        ("store-0", 16),  # prefill workers are fetching from and writing back to the store
    ],
)
def test_a_killed_process_costs_no_stream(supervised, victim, kill_after_first_tokens):
    cluster = supervised
    cluster.wait_for(_all_idle(cluster), timeout=60)
    load = ChatLoad(cluster.gateway_url, MODEL, PROMPTS, max_tokens=MAX_TOKENS)
    killed_at: dict[str, float] = {}
    pids_before = cluster.pids

    async def scenario():
        nonlocal victim
        started = asyncio.Event()
        streams = asyncio.create_task(run_streams(load, started, started_after=kill_after_first_tokens))
        await asyncio.wait_for(started.wait(), timeout=120)
        if victim == "decode":  # the one holding the most streams (the conductor need not split them evenly)
            decodes = [hb for hb in cluster.instances.values() if hb.role == "decode"]
            victim = max(decodes, key=lambda hb: (hb.load, hb.instance_id)).instance_id
        killed_at["wall"], killed_at["mono"] = time.time(), time.monotonic()
        await asyncio.to_thread(cluster.kill, victim)
        return await streams

    outcomes = asyncio.run(scenario())
    old_pid = pids_before[victim]
    result = tally(outcomes)
    assert result.broken == 0, f"{victim}: {result.line()}"
    assert result.completed >= 0.95 * NUM_STREAMS, f"{victim}: {result.line()}"
    assert result.max_silence_s < 10.0, f"{victim}: {result.line()}"
    if victim.startswith("decode"):
        assert result.migrated > 0, f"no stream moved off {victim}: {result.line()}"

    # serving again: a new process under the same id has reported in
    remaining = BACK_WITHIN_S - (time.monotonic() - killed_at["mono"])
    cluster.wait_for(
        lambda hbs: victim in hbs and hbs[victim].started_at > killed_at["wall"], timeout=max(remaining, 0.1)
    )
    assert cluster.pids[victim] != old_pid
    wait_until(lambda: _segments_of({old_pid}) == [], timeout=10)


def test_nats_server_killed_readiness_fails_then_everything_reconnects_and_serves(supervised):
    cluster = supervised
    cluster.wait_for(_all_idle(cluster), timeout=60)
    ready_url = cluster.gateway_url + "/health/ready"
    nats_pid = cluster.nats_pid
    load = ChatLoad(cluster.gateway_url, MODEL, PROMPTS, max_tokens=MAX_TOKENS)
    in_flight = {}

    async def scenario() -> list[int]:
        statuses = []
        started = asyncio.Event()
        in_flight["streams"] = asyncio.create_task(run_streams(load, started, started_after=NUM_STREAMS // 2))
        await asyncio.wait_for(started.wait(), timeout=120)
        async with aiohttp.ClientSession() as session:
            os.kill(nats_pid, signal.SIGKILL)

            async def ready() -> list[int]:
                async with session.get(ready_url) as response:
                    statuses.append(response.status)
                return statuses

            # readiness drops while NATS is down, then comes back once it is restarted
            await poll_until(ready, lambda seen: 503 in seen and seen[-1] == 200, 30,
                             "readiness did not drop and come back around the nats-server restart", interval=0.02)
        in_flight["outcomes"] = await in_flight["streams"]
        return statuses

    statuses = asyncio.run(scenario())
    # the streams cut by the outage go on: tokens published while NATS was down are lost,
    # so the gateway continues each stuck stream elsewhere from the tokens it has
    result = tally(in_flight["outcomes"])
    assert result.broken == 0, f"nats-server: {result.line()}"
    assert result.completed >= 0.95 * NUM_STREAMS, f"nats-server: {result.line()}"
    # a control request whose reply was lost with the old connection waits out its own
    # timeout (15 s at most) before the request moves: slower than a death, never a hang
    assert result.max_silence_s < 30.0, f"nats-server: {result.line()}"
    assert 503 in statuses, "readiness never failed while nats-server was down"
    assert statuses[-1] == 200, "readiness did not come back after nats-server was restarted"
    assert cluster.nats_pid != nats_pid
    restarted_at = time.time()
    cluster.wait_for(  # every service heard from again, over the new nats-server
        lambda hbs: all(i in hbs for i in cluster.instance_ids), timeout=30
    )
    client = OpenAI(base_url=cluster.gateway_url + "/v1", api_key="unused", max_retries=0)

    def serves() -> bool:
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Name a color."}], max_tokens=4, temperature=0
        )
        return bool(out.choices[0].message.content)

    wait_until(serves, timeout=30)
    assert time.time() >= restarted_at


def _descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                if child not in found:
                    found.add(child)
                    todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(entry.split("=", 1) for entry in raw.decode(errors="replace").split("\0") if "=" in entry)


def test_kill_9_of_kvserve_up_leaves_no_process_segment_or_credential(tmp_path):
    # Its temporary directories go to tmp_path, so that whatever it left there is seen.
    env = {**os.environ, **CLUSTER_ENV, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvserve.cli.main", "up", "--port", "0", "--dtype", "auto"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    children: set[int] = set()
    try:
        for line in proc.stdout:
            if re.search(r"kvserve is up: http://127\.0\.0\.1:\d+/v1", line):
                break
        else:
            pytest.fail("kvserve up exited before printing its URL")
        children = _descendants(proc.pid)
        services = 5 + default_shared_prefill(1, 1, available_cpus())  # and the shared prefill worker
        assert len(children) >= services + 2, f"expected nats-server, {services} services and the watchdog: {children}"
        environs = [_environ(pid) for pid in children]
        credentials = {Path(e["KVSERVE_NATS_CREDENTIALS"]) for e in environs if "KVSERVE_NATS_CREDENTIALS" in e}
        runtime = {Path(e["KVSERVE_CALIBRATION_FILE"]).parent for e in environs if "KVSERVE_CALIBRATION_FILE" in e}
        assert len(credentials) == services and all(path.exists() for path in credentials)  # one per instance
        assert len(runtime) == 1
        (runtime_dir,) = runtime
        assert runtime_dir.parent == tmp_path and runtime_dir.exists()
        segments = _segments_of(children)
        assert len(segments) >= 3, f"expected the workers' KV pools and the store's DRAM, found {segments}"
        proc.kill()
        proc.wait()
        # The watchdog exits last, once it has cleaned up.
        wait_until(lambda: not any(_alive(pid) for pid in children), timeout=30)
        assert _segments_of(children) == []
        assert [path for path in credentials if path.exists()] == []
        assert not runtime_dir.exists() and sorted(path.name for path in tmp_path.glob("kvserve-*")) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
        for pid in children:  # only when the test fails: leave nothing behind
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        for name in _segments_of(children):
            (Path("/dev/shm") / name).unlink(missing_ok=True)
