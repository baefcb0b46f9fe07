"""Two conductor replicas, active-active, with real processes: one, holding
admissions unanswered (a failpoint), is killed with SIGKILL while streaming requests
are being admitted and served, and every request still completes (the gateway asks
the survivor again), the survivor admitting what comes after."""

import asyncio
import concurrent.futures
import signal
import threading

import nats
from openai import OpenAI

from kvserve.cli.cluster import LocalCluster
from libs.protocol import schema, subjects
from libs.protocol.schema import MetricsReply, MetricsRequest
from tests.integration.conftest import CLUSTER_ENV, STARTED, metric_value, wait_until

MODEL = "SmolLM2-135M-Instruct"
QUESTIONS = [f"In one sentence, what is {n} plus {n}?" for n in range(12)]
LOAD_TIMEOUT = 90.0  # seconds for the whole load, the kill included


def admitted_by(cluster: LocalCluster, instance_id: str) -> float:
    """The conductor's kvserve_requests_admitted_total, asked over NATS."""

    async def ask() -> float:
        nc = await nats.connect(cluster.nats_url)
        try:
            msg = await nc.request(subjects.metrics(instance_id), schema.encode(MetricsRequest()), timeout=10)
        finally:
            await nc.close()
        return metric_value(schema.decode(msg.data, MetricsReply).text, "kvserve_requests_admitted_total")

    return asyncio.run(ask())


def test_killing_one_of_two_conductors_mid_load_loses_no_request():
    env = {**CLUSTER_ENV, "KVSERVE_FAILPOINTS": "conductor-0:conductor.stall_admit"}
    cluster = LocalCluster(prefill=1, decode=1, conductors=2, store=False, gateway_port=0, dtype="float32", env=env,
                           log=None)  # fmt: skip
    STARTED.append(cluster)
    try:
        cluster.start(timeout=120)
        assert {"conductor-0", "conductor-1"} <= set(cluster.instances)
        client = OpenAI(base_url=cluster.gateway_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        first_tokens = threading.Semaphore(0)

        def ask(question: str) -> tuple[str, str]:
            stream = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=12, temperature=0,
                stream=True,
            )  # fmt: skip
            text, finish, first = [], None, True
            for chunk in stream:
                if chunk.choices and (delta := chunk.choices[0].delta.content):
                    text.append(delta)
                    if first:
                        first_tokens.release()
                        first = False
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
            return "".join(text), finish

        def holding() -> bool:
            return any("conductor.stall_admit: holding" in line for line in cluster.logs("conductor-0"))

        # Four at a time: when the kill comes, conductor-0 holds an admission, some
        # requests are streaming and the rest are still to be admitted.
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(ask, q) for q in QUESTIONS]
            assert first_tokens.acquire(timeout=LOAD_TIMEOUT)
            wait_until(holding, timeout=LOAD_TIMEOUT)
            cluster.kill("conductor-0", signal.SIGKILL)
            done, pending = concurrent.futures.wait(futures, timeout=LOAD_TIMEOUT)
            assert not pending, f"{len(pending)} requests did not complete"
            answers = [f.result() for f in futures]  # raises if any request failed
        assert all(text and finish in ("stop", "length") for text, finish in answers), answers

        before = admitted_by(cluster, "conductor-1")
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=8,
            temperature=0,
        )  # fmt: skip
        assert out.choices[0].message.content
        assert admitted_by(cluster, "conductor-1") == before + 1  # the survivor admitted it
    finally:
        cluster.stop()
