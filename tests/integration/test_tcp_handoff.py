"""The TCP data path end to end: prefill and decode forced to hand KV over TCP."""

import urllib.request

from openai import OpenAI

from libs.engine.model.engine import EngineConfig
from libs.engine.model.generator import Generator
from libs.engine.model.loader import build_engine
from libs.protocol.sampling_params import SamplingParams
from tests.integration.conftest import metric_value, metrics_of, start_cluster

MODEL = "SmolLM2-135M-Instruct"


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
        assert metric_value(text, "kvserve_transfer_bytes_total", transport="tcp") > 0
        assert metric_value(text, "kvserve_transfer_bytes_total", transport="shm") == 0
        received = metrics_of(cluster, "decode-0")
        assert metric_value(received, "kvserve_transfer_received_bytes_total") > 0
        # the gateway's /metrics gathers every instance's, labelled by instance
        scraped = urllib.request.urlopen(cluster.gateway_url + "/metrics", timeout=10).read().decode()
        assert metric_value(scraped, "kvserve_transfer_bytes_total", instance="prefill-0", transport="tcp") > 0
        assert metric_value(scraped, "kvserve_transfer_received_bytes_total", instance="decode-0") > 0
    finally:
        cluster.stop()
