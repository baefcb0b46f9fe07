"""Hand-offs that fail in a real cluster (KV over TCP): the request is retried on
the other decode worker, answers correctly, and no block leaks on either side."""

from openai import OpenAI

from libs.engine.model.engine import EngineConfig
from libs.engine.model.generator import Generator
from libs.engine.model.loader import build_engine
from libs.protocol.sampling_params import SamplingParams
from tests.integration.conftest import start_cluster, wait_until

MODEL = "SmolLM2-135M-Instruct"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def all_blocks_free(cluster) -> bool:
    workers = [hb for hb in cluster.instances.values() if hb.role in ("prefill", "decode")]
    return all(hb.free_blocks == hb.capacity and hb.load == 0 for hb in workers)


def test_a_stalled_then_killed_decode_worker_is_routed_around_without_leaks(smollm):
    engine = build_engine(smollm, EngineConfig(num_blocks=64, enable_prefix_cache=False))
    prompt = smollm.tokenizer.encode_chat(MESSAGES)
    expected = Generator(engine, smollm.tokenizer).generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0]
    cluster = start_cluster(decode=2, env={
        "KVSERVE_TRANSPORT": "tcp", "KVSERVE_TRANSFER_TIMEOUT": "3", "KVSERVE_USE_STORE": "0",
        "KVSERVE_FAILPOINTS": "decode-0:transfer.stall_receive",
        "KVSERVE_POLICY": "least_loaded",  # idle and equal, so decode-0 (the first by id) is tried first
    })  # fmt: skip
    try:
        client = OpenAI(base_url=cluster.gateway_url + "/v1", api_key="unused", max_retries=0)
        cluster.wait_for(lambda hbs: all_blocks_free(cluster), timeout=10)

        # 1. decode-0 takes the token, then never reads: the transfer times out, the lease on
        #    decode-0 is released, and decode-1 gets the request
        out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
        assert out.choices[0].message.content == expected.text
        assert any("timeout" in line and "decode-0" in line for line in cluster.logs("prefill-0"))
        cluster.wait_for(lambda hbs: all_blocks_free(cluster), timeout=15)

        # 2. the same, but decode-0 is killed while the transfer hangs
        stalls_before = sum("not reading" in line for line in cluster.logs("decode-0"))

        def hanging() -> bool:
            return sum("not reading" in line for line in cluster.logs("decode-0")) > stalls_before

        import threading

        answer = {}
        thread = threading.Thread(target=lambda: answer.setdefault("out", client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)))  # fmt: skip
        thread.start()
        wait_until(hanging, timeout=30)
        cluster.kill("decode-0")
        thread.join(timeout=60)
        assert answer["out"].choices[0].message.content == expected.text
        cluster.wait_for(
            lambda hbs: all(hb.free_blocks == hb.capacity for i, hb in hbs.items()
                            if i in ("prefill-0", "decode-1")), timeout=15,
        )  # fmt: skip
    finally:
        cluster.stop()
