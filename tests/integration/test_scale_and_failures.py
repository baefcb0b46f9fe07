"""Several workers sharing the load, a role going missing, and `kvserve up` end to end."""

import concurrent.futures
import os
import re
import signal
import subprocess
import sys

from openai import APIStatusError, OpenAI

from libs.engine.model.engine import EngineConfig
from libs.engine.model.generator import Generator
from libs.engine.model.loader import build_engine
from libs.protocol.sampling_params import SamplingParams
from tests.integration.conftest import CLUSTER_ENV, start_cluster, wait_until

MODEL = "SmolLM2-135M-Instruct"
QUESTIONS = [
    "What is the capital of France?", "Name a primary color.", "What is 3 plus 4?", "Say hi in Spanish.",
    "What do bees make?", "Name a planet.", "What color is the sky?", "What is ice made of?",
]  # fmt: skip


def test_two_prefill_two_decode_share_eight_concurrent_requests(smollm):
    # Sharing is what is checked here, so the router that shares by count: cache_aware follows
    # each worker's calibrated cost model, and workers calibrated side by side on one busy
    # machine can differ enough for it to send all eight to one of them.
    cluster = start_cluster(prefill=2, decode=2, env={"KVSERVE_POLICY": "least_loaded"})
    try:
        client = OpenAI(base_url=cluster.gateway_url + "/v1", api_key="unused", max_retries=0)

        def ask(question: str):
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=16, temperature=0
            )
            return raw.headers, raw.parse().choices[0].message.content

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, QUESTIONS))
        engine = build_engine(smollm, EngineConfig(num_blocks=256, enable_prefix_cache=False))
        prompts = [smollm.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
        expected = Generator(engine, smollm.tokenizer).generate(prompts, SamplingParams(max_tokens=16, temperature=0))
        assert [text for _, text in answers] == [e.text for e in expected]
        assert {h["x-kvserve-prefill-instance"] for h, _ in answers} == {"prefill-0", "prefill-1"}
        assert {h["x-kvserve-decode-instance"] for h, _ in answers} == {"decode-0", "decode-1"}
    finally:
        cluster.stop()


def test_with_no_decode_worker_coming_back_requests_end_in_503():
    cluster = start_cluster(env={"KVSERVE_INSTANCE_TIMEOUT": "3", "KVSERVE_GATEWAY_ADMIT_RETRY_WINDOW": "4"})
    try:
        client = OpenAI(base_url=cluster.gateway_url + "/v1", api_key="unused", max_retries=0)
        cluster.kill("decode-0", signal.SIGKILL)

        def refused() -> bool:
            try:
                client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            except APIStatusError as e:
                return e.status_code == 503 and "no decode instance is alive" in e.message
            return False

        # a request waits up to the retry window (4 s here) for a decode worker heard from lately
        # (it may be restarting); none comes back here, so one ends in 503, and once the window
        # has passed one fails at once
        wait_until(refused, timeout=60)
    finally:
        cluster.stop()


def test_kvserve_up_prints_its_url_serves_and_stops_on_ctrl_c():
    env = {**os.environ, **CLUSTER_ENV, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvserve.cli.main", "up", "--port", "0", "--dtype", "float32"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    try:
        url = None
        for line in proc.stdout:  # the launcher prints its ready block once every service has reported in
            if match := re.search(r"kvserve is up: (http://127\.0\.0\.1:\d+/v1)", line):
                url = match.group(1)
                break
        assert url is not None, "kvserve up exited before printing its URL"
        client = OpenAI(base_url=url, api_key="unused", max_retries=0)
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=16,
            temperature=0,
        )  # fmt: skip
        assert "Paris" in out.choices[0].message.content
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
