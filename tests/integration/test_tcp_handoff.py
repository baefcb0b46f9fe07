"""The TCP data path end to end: prefill and decode forced to hand KV over TCP."""

import asyncio
import urllib.request

import nats
from openai import OpenAI

from libs.common import schema, subjects
from libs.common.model.engine import EngineConfig
from libs.common.model.generator import Generator
from libs.common.model.loader import build_engine
from libs.common.sampling_params import SamplingParams
from tests.integration.conftest import start_cluster

MODEL = "SmolLM2-135M-Instruct"


def metrics_of(cluster, instance_id: str) -> str:
    async def ask() -> str:
        nc = await nats.connect(cluster.nats_url)
        try:
            reply = await nc.request(subjects.metrics(instance_id), schema.encode(schema.MetricsRequest()), timeout=5)
            return schema.decode(reply.data, schema.MetricsReply).text
        finally:
            await nc.close()

    return asyncio.run(ask())


def test_kv_goes_over_tcp_and_the_answer_is_unchanged(smollm):
    messages = [{"role": "user", "content": "Write one sentence about the moon and the tides."}]
    engine = build_engine(smollm, EngineConfig(num_blocks=64, enable_prefix_cache=False))
    expected = Generator(engine, smollm.tokenizer).generate(
        [smollm.tokenizer.encode_chat(messages)], SamplingParams(max_tokens=24, temperature=0)
    )[0]
    cluster = start_cluster(env={"KVSERVE_TRANSPORT": "tcp"})
    try:
        client = OpenAI(base_url=cluster.gateway_url + "/v1", api_key="unused", max_retries=0)
        out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
        assert out.choices[0].message.content == expected.text
        text = metrics_of(cluster, "prefill-0")
        tcp = [line for line in text.splitlines() if line.startswith('kvserve_transfer_bytes_total{transport="tcp"}')]
        assert tcp and float(tcp[0].split()[-1]) > 0
        assert 'kvserve_transfer_bytes_total{transport="shm"}' not in text
        received = metrics_of(cluster, "decode-0")
        assert float(next(line for line in received.splitlines()
                          if line.startswith("kvserve_transfer_received_bytes_total")).split()[-1]) > 0  # fmt: skip
        # the gateway's /metrics gathers every instance's, labelled by instance
        scraped = urllib.request.urlopen(cluster.gateway_url + "/metrics", timeout=10).read().decode()
        assert 'kvserve_transfer_bytes_total{instance="prefill-0",transport="tcp"}' in scraped
        assert 'kvserve_transfer_received_bytes_total{instance="decode-0"}' in scraped
    finally:
        cluster.stop()
