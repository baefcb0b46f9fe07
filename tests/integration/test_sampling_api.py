"""Sampling controls and logprobs through the whole cluster with the official client:
logprobs equal the engine's own logits, and a request with penalties, min-p, logit bias
or min_tokens gets the tokens the one-process engine samples (its first token from the
prefill worker, the rest from the decode worker)."""

import pytest
import torch

from libs.engine.model import steps
from libs.engine.model.engine import EngineConfig
from libs.engine.model.generator import Generator
from libs.engine.model.loader import build_engine
from libs.engine.model.sequence import Sequence
from libs.protocol.sampling_params import SamplingParams

MODEL = "SmolLM2-135M-Instruct"
MESSAGES = [{"role": "user", "content": "Write a short poem about the sea."}]


def in_process(smollm, prompt: list[int], params: SamplingParams):
    engine = build_engine(smollm, EngineConfig(num_blocks=128, enable_prefix_cache=False))
    return list(Generator(engine, smollm.tokenizer).stream(prompt, params))


def test_chat_logprobs_are_the_engines_log_softmax_streamed_and_whole(openai_client, smollm):
    tok = smollm.tokenizer
    request = dict(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0, logprobs=True, top_logprobs=3)
    whole = openai_client.chat.completions.create(**request).choices[0].logprobs.content
    prompt = tok.encode_chat(MESSAGES)
    ids = [out.token_id for out in in_process(smollm, prompt, SamplingParams(max_tokens=10, temperature=0))]
    assert [bytes(entry.bytes) for entry in whole] == [tok.token_bytes(i) for i in ids]  # the same tokens
    engine = build_engine(smollm, EngineConfig(num_blocks=128, enable_prefix_cache=False))
    (logits,) = steps.prefill_all_logits(engine, [Sequence.from_prompt("reference", prompt + ids)])
    for k, entry in enumerate(whole):
        expected = torch.log_softmax(logits[len(prompt) - 1 + k], dim=-1)
        assert entry.logprob == pytest.approx(expected[ids[k]].item(), abs=2e-3)
        top = expected.topk(3)
        assert [bytes(t.bytes) for t in entry.top_logprobs] == [tok.token_bytes(i) for i in top.indices.tolist()]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=2e-3)
        assert entry.token == tok.token_bytes(ids[k]).decode(errors="replace")

    stream = openai_client.chat.completions.create(**request, stream=True)
    streamed = [e for chunk in stream for c in chunk.choices if c.logprobs is not None for e in c.logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in whole]


def test_penalties_and_logprobs_match_the_one_process_engine(openai_client, smollm):
    request = dict(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0, frequency_penalty=0.8,
                   presence_penalty=0.5, logprobs=True, top_logprobs=2)  # fmt: skip
    out = openai_client.chat.completions.create(**request, extra_body={"repetition_penalty": 1.3})
    params = SamplingParams(max_tokens=16, temperature=0, frequency_penalty=0.8, presence_penalty=0.5,
                            repetition_penalty=1.3, logprobs=2)  # fmt: skip
    reference = in_process(smollm, smollm.tokenizer.encode_chat(MESSAGES), params)
    assert out.choices[0].message.content == "".join(o.text for o in reference)
    got = out.choices[0].logprobs.content
    assert [e.logprob for e in got] == pytest.approx([o.logprobs.logprob for o in reference], abs=2e-3)
    plain = openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0)
    assert plain.choices[0].message.content != out.choices[0].message.content  # the penalties changed the answer


def test_a_seeded_min_p_request_draws_what_the_one_process_engine_draws(openai_client, smollm):
    out = openai_client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0,
                                           seed=11, extra_body={"min_p": 0.05, "ignore_eos": True})  # fmt: skip
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=11, min_p=0.05, ignore_eos=True)
    reference = in_process(smollm, smollm.tokenizer.encode("Once upon a time"), params)
    assert out.choices[0].text == "".join(o.text for o in reference)


def test_logit_bias_and_min_tokens_hold_on_the_prefill_and_the_decode_worker(openai_client, smollm):
    eos = smollm.tokenizer.eos_token_ids[0]
    request = dict(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0,
                   logit_bias={str(eos): 100})  # fmt: skip
    at_once = openai_client.completions.create(**request)
    assert (at_once.usage.completion_tokens, at_once.choices[0].finish_reason) == (1, "stop")  # the prefill's token
    held = openai_client.completions.create(**request, extra_body={"min_tokens": 5})
    assert (held.usage.completion_tokens, held.choices[0].finish_reason) == (6, "stop")  # five, then the biased eos


def test_completion_logprobs_in_the_completions_shape(openai_client):
    out = openai_client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6,
                                           temperature=0, logprobs=2, extra_body={"ignore_eos": True})  # fmt: skip
    choice = out.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and top[token] == pytest.approx(logprob) and logprob == pytest.approx(max(top.values()))


def test_n_choices_come_from_one_prefill_streamed_and_whole(openai_client, smollm):
    request = dict(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=5, n=4,
                   extra_body={"ignore_eos": True})  # fmt: skip
    whole = openai_client.chat.completions.create(**request)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    texts = [c.message.content for c in whole.choices]
    assert len(set(texts)) > 1  # each sequence draws its own tokens
    alone = openai_client.chat.completions.create(**{**request, "n": 1})
    assert texts[0] == alone.choices[0].message.content  # the first draws as a request for one
    assert whole.usage.prompt_tokens == alone.usage.prompt_tokens  # the prompt counted once
    assert whole.usage.completion_tokens == 4 * 8

    pieces, finishes = ["", "", "", ""], {}
    for chunk in openai_client.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            pieces[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert pieces == texts and finishes == {0: "length", 1: "length", 2: "length", 3: "length"}


def test_n_greedy_choices_are_the_engines_one_answer(openai_client, smollm):
    out = openai_client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                           temperature=0, n=3, logprobs=1)  # fmt: skip
    reference = in_process(smollm, smollm.tokenizer.encode("The capital of France is"),
                           SamplingParams(max_tokens=8, temperature=0))  # fmt: skip
    text = "".join(o.text for o in reference)
    assert [c.text for c in out.choices] == [text] * 3
    assert out.choices[2].logprobs.tokens == out.choices[0].logprobs.tokens
