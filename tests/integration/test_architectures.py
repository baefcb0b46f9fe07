"""`kvserve up --model X.gguf` for the architectures beyond Llama: a tiny Qwen3 and a
tiny Phi-3, as llama.cpp's converter writes them, served through all five services
(prefill on one worker, its KV handed to the decode worker) answer what the
one-process engine answers on the same file: the same tokens with the same
log-probabilities (a random tiny model may repeat one token; its logprobs still
tell a wrong forward apart)."""

import tempfile

import pytest

from kvserve.cli.cluster import LocalCluster
from libs.engine.model import steps
from libs.engine.model.engine import EngineConfig
from libs.engine.model.generator import Generator
from libs.engine.model.loader import build_engine, load_model
from libs.engine.model.sequence import Sequence
from libs.protocol.sampling_params import SamplingParams
from tests.conftest import tiny_architecture_gguf
from tests.integration.conftest import CLUSTER_ENV, STARTED

PROMPT = list(range(40, 110))  # 70 byte tokens: four full blocks and a partial one


@pytest.mark.parametrize("arch", ["qwen3", "phi3"])
def test_a_cluster_serves_a_gguf_of_the_architecture_as_one_process_does(arch):
    from openai import OpenAI

    path = tiny_architecture_gguf(arch, "f32")
    loaded = load_model(str(path), dtype="float32", progress=False)
    engine = build_engine(loaded, EngineConfig(num_blocks=64, enable_prefix_cache=False))
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = Generator(engine, loaded.tokenizer).generate([PROMPT], greedy)[0]
    logits = steps.prefill_all_logits(engine, [Sequence.from_prompt("all", PROMPT + expected.token_ids[:-1])])[0]
    logprobs = logits[len(PROMPT) - 1 :].log_softmax(-1)[range(12), expected.token_ids].tolist()

    cluster = LocalCluster(prefill=1, decode=1, gateway_port=0, log=None, env=CLUSTER_ENV, model=str(path),
                           dtype="float32", store_dir=tempfile.mkdtemp(prefix="kvserve-stores-"))  # fmt: skip
    STARTED.append(cluster)
    cluster.start(timeout=120)
    try:
        client = OpenAI(base_url=cluster.gateway_url + "/v1", api_key="unused", max_retries=0)
        out = client.completions.create(model=cluster.model_id, prompt=PROMPT, max_tokens=12, temperature=0,
                                        logprobs=0, extra_body={"ignore_eos": True})  # fmt: skip
        assert out.usage.completion_tokens == len(expected.token_ids) == 12
        assert out.choices[0].text == expected.text
        served = out.choices[0].logprobs.token_logprobs
        assert max(abs(a - b) for a, b in zip(served, logprobs, strict=True)) < 1e-4
    finally:
        cluster.stop()
