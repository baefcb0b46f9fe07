"""One chat request through all five services, against the one-process engine."""

import json
import urllib.request

import pytest

from libs.common.nats_flush import flush
from libs.engine.model.engine import EngineConfig
from libs.engine.model.generator import Generator
from libs.engine.model.loader import build_engine
from libs.protocol.sampling_params import SamplingParams
from tests.integration.conftest import wait_until

MODEL = "SmolLM2-135M-Instruct"


def reference(smollm, messages, max_tokens: int) -> str:
    """What the engine says in one process, greedy, no caches."""
    engine = build_engine(smollm, EngineConfig(num_blocks=128, enable_prefix_cache=False))
    prompt = smollm.tokenizer.encode_chat(messages)
    return Generator(engine, smollm.tokenizer).generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0))[0].text


def test_openai_client_streams_the_engine_answer_token_for_token(openai_client, smollm):
    messages = [{"role": "user", "content": "Name three things that are red."}]
    stream = openai_client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=40, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    pieces, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert len([p for p in pieces if p]) > 3  # it streamed, not one lump
    assert "".join(pieces) == reference(smollm, messages, 40)
    assert finish in ("stop", "length")
    assert usage.prompt_tokens == len(smollm.tokenizer.encode_chat(messages))
    assert usage.completion_tokens > 0


def test_a_shared_long_prefix_is_served_from_cache_with_the_same_output(openai_client, smollm):
    story = "Once upon a time, in a valley between two rivers, there was a village of potters. " * 6
    first = [{"role": "system", "content": story}, {"role": "user", "content": "Who lived in the valley?"}]
    second = [{"role": "system", "content": story}, {"role": "user", "content": "What did they make?"}]
    a = openai_client.chat.completions.create(model=MODEL, messages=first, max_tokens=24, temperature=0)
    b = openai_client.chat.completions.create(model=MODEL, messages=second, max_tokens=24, temperature=0)
    assert b.usage.prompt_tokens_details.cached_tokens >= 16 * 6
    assert b.usage.prompt_tokens_details.cached_tokens % 16 == 0
    assert a.choices[0].message.content == reference(smollm, first, 24)
    assert b.choices[0].message.content == reference(smollm, second, 24)


def test_completions_endpoint_and_models_list(openai_client, smollm):
    models = openai_client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    out = openai_client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    engine = build_engine(smollm, EngineConfig(num_blocks=64, enable_prefix_cache=False))
    ref = Generator(engine, smollm.tokenizer).generate(
        [smollm.tokenizer.encode("The capital of France is")], SamplingParams(max_tokens=8, temperature=0)
    )[0]
    assert out.choices[0].text == ref.text
    assert out.usage.completion_tokens == len(ref.token_ids)


def test_a_one_token_answer_whose_token_has_no_text_says_so_as_vllm_does(openai_client):
    """After a finished assistant turn the model's next token is <|im_end|>, its end of
    sequence. Under ignore_eos and max_tokens 1 it is the whole answer: counted in usage,
    no text, shown as "" in the chunk with the finish reason (vLLM's answer)."""
    prompt = "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\nHello! How can I help you today?"
    request = dict(model=MODEL, prompt=prompt, temperature=0)
    stopped = openai_client.completions.create(max_tokens=4, **request)
    assert (stopped.choices[0].text, stopped.choices[0].finish_reason, stopped.usage.completion_tokens) == ("", "stop", 1)

    one = dict(max_tokens=1, extra_body={"ignore_eos": True}, **request)
    answer = openai_client.completions.create(**one)
    assert (answer.choices[0].text, answer.choices[0].finish_reason, answer.usage.completion_tokens) == ("", "length", 1)
    chunks = list(openai_client.completions.create(stream=True, stream_options={"include_usage": True}, **one))
    assert [(c.choices[0].text, c.choices[0].finish_reason) for c in chunks if c.choices] == [("", "length")]
    assert chunks[-1].usage.completion_tokens == 1


def test_a_client_that_disconnects_mid_stream_frees_its_decode_blocks(cluster):
    capacity = {i: hb.capacity for i, hb in cluster.instances.items() if hb.role == "decode"}
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Count to one thousand."}],
                       "max_tokens": 2000, "ignore_eos": True, "temperature": 0, "stream": True}).encode()  # fmt: skip
    request = urllib.request.Request(cluster.gateway_url + "/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})  # fmt: skip
    response = urllib.request.urlopen(request, timeout=60)
    lines = 0
    while lines < 6:  # a few tokens in: the request holds decode blocks now
        if response.readline().startswith(b"data:"):
            lines += 1
    busy = lambda hbs: any(hb.role == "decode" and hb.free_blocks < capacity[i] for i, hb in hbs.items())  # noqa: E731
    cluster.wait_for(busy, timeout=30)
    response.close()  # the client goes away
    cluster.wait_for(
        lambda hbs: all(hbs[i].free_blocks == capacity[i] and hbs[i].load == 0 for i in capacity), timeout=30
    )


@pytest.mark.parametrize(
    "body, status, param",
    [
        (b"{not json", 400, None),
        ({"model": MODEL}, 400, "messages"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100_000}, 400, "max_tokens"),
        ({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, 404, None),  # as OpenAI: code model_not_found
        ({"model": MODEL, "messages": [{"role": "user", "content": "word " * 9000}]}, 400, "messages"),
    ],
    ids=["malformed-json", "no-messages", "max-tokens-0", "max-tokens-over-context", "unknown-model", "prompt-too-long"],
)
def test_bad_input_gets_an_openai_error(cluster, body, status, param):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(cluster.gateway_url + "/v1/chat/completions", data,
                                     {"Content-Type": "application/json"})  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=30)
    assert caught.value.code == status
    error = json.loads(caught.value.read())["error"]
    assert error["message"]
    assert error["type"] in ("invalid_request_error", "not_found_error")
    assert error["param"] == param
    if status == 404:
        assert error["code"] == "model_not_found"


def test_undecodable_nats_messages_are_logged_and_dropped(cluster, openai_client, smollm):
    import asyncio

    import nats

    from libs.protocol import subjects

    targets = [subjects.CONDUCTOR_ADMIT, subjects.prefill_submit("prefill-0"), subjects.decode_reserve("decode-0"),
               subjects.decode_admit("decode-0"), subjects.store_op("store-0", "put"), subjects.CANCEL]  # fmt: skip

    async def send_garbage():
        nc = await nats.connect(cluster.nats_url)
        for subject in targets:
            await nc.publish(subject, b"\x93garbage")
        await flush(nc)
        await nc.close()

    asyncio.run(send_garbage())
    # every service still answers, and said what it dropped
    messages = [{"role": "user", "content": "Say hello."}]
    out = openai_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert out.choices[0].message.content == reference(smollm, messages, 8)
    for instance in ("conductor-0", "prefill-0", "decode-0", "store-0"):
        wait_until(lambda: any("dropped a message" in line for line in cluster.logs(instance)), timeout=10)
    assert all(cluster.instances[i].role for i in ("conductor-0", "prefill-0", "decode-0", "store-0", "gateway-0"))
