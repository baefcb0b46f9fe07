"""Stopping a cluster stops every service cleanly: each drains and exits 0 on SIGTERM,
none ends in a traceback (an attribute shadowing a service's stop() once did), and
the gateway stops first, so the streams in flight finish on workers still running.
A launcher killed outright (kill -9) takes its workers with it, but its gateway still
ends every stream with an error and [DONE], then exits."""

import json
import os
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

from tests.integration.conftest import start_cluster, wait_until
from tests.unit.cli.harness import is_alive, kill_leftovers

ROOT = Path(__file__).resolve().parents[2]
STREAM_TOKENS = 32  # a few seconds of decoding: well within the gateway's 10 s drain
MODEL = "SmolLM2-135M-Instruct"


class Streams:
    """Chat streams posted in threads; each one's SSE data lines, as they come."""

    def __init__(self, url: str, count: int, max_tokens: int) -> None:
        self.started = [threading.Event() for _ in range(count)]
        self.events: list[list[str]] = [[] for _ in range(count)]
        self.threads = [threading.Thread(target=self._stream, args=(url, i, max_tokens)) for i in range(count)]
        for t in self.threads:
            t.start()

    def _stream(self, url: str, i: int, max_tokens: int) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"Tell story {i}."}], "stream": True,
                "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
                "stream_options": {"include_usage": True}}  # fmt: skip
        post = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                      {"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(post, timeout=120) as r:
            for line in r:
                if line.startswith(b"data: "):
                    self.events[i].append(line.removeprefix(b"data: ").strip().decode())
                    self.started[i].set()

    def wait_started(self) -> bool:
        return all(started.wait(120) for started in self.started)

    def join(self) -> list[list[str]]:
        for t in self.threads:
            t.join(120)
        assert not any(t.is_alive() for t in self.threads), "a stream hangs"
        return self.events


def test_every_service_exits_zero_when_the_cluster_stops(smollm):
    cluster = start_cluster()
    cluster.stop()
    codes = cluster.exit_codes()
    assert {"prefill-0", "decode-0", "conductor-0", "gateway-0"} <= codes.keys()
    assert codes == {instance: 0 for instance in codes}


def test_streams_in_flight_when_the_cluster_stops_finish_before_their_workers_stop(smollm):
    cluster = start_cluster()
    streams = Streams(cluster.gateway_url, 2, STREAM_TOKENS)
    try:
        assert streams.wait_started(), "the streams did not start"
    finally:
        cluster.stop()  # as Ctrl-C or SIGTERM to `kvserve up`
    for events in streams.join():
        assert events[-1] == "[DONE]", events[-3:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert not [c for c in chunks if "error" in c]
        finish, usage = chunks[-2:]
        assert finish["choices"][0]["finish_reason"] == "length"
        assert usage["usage"]["completion_tokens"] == STREAM_TOKENS


def test_a_launcher_killed_mid_stream_still_ends_every_stream_with_an_error_and_done(smollm):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    launcher = subprocess.Popen([sys.executable, "-m", "tests.integration.launched_cluster"], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, text=True)  # fmt: skip
    pids: dict[str, int] = {}
    try:
        line = launcher.stdout.readline()
        assert line.startswith("cluster "), f"the launcher exited first ({launcher.poll()})"
        started = json.loads(line.removeprefix("cluster "))
        pids = started["pids"]
        streams = Streams(started["url"], 2, 4000)  # far more than decodes before the kill
        assert streams.wait_started(), "the streams did not start"
        launcher.kill()  # SIGKILL: no stop in order; the workers and nats-server die with it
        launcher.wait()
        for events in streams.join():
            assert events[-1] == "[DONE]", events[-3:]
            chunks = [json.loads(e) for e in events[:-1]]
            errors = [c["error"] for c in chunks if "error" in c]
            assert [e["type"] for e in errors] == ["server_error"] and errors[0]["code"] != "internal_error"
            assert [c["choices"][0]["finish_reason"] for c in chunks[-2:-1]] == ["error"]
        wait_until(lambda: not any(is_alive(pid) for pid in pids.values()), timeout=60)  # the gateway exits too
    finally:
        kill_leftovers(launcher, pids.values())
