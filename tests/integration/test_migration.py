"""A worker killed (SIGKILL) under a streaming request, with no supervisor to tear
the cluster down: the gateway notices from the heartbeats, moves the request to
live workers, and the client's one stream carries the text an undisturbed run
gives, then [DONE]."""

import json
import urllib.request
from collections.abc import Iterator
from http.client import HTTPResponse

from libs.engine.model.engine import EngineConfig
from libs.engine.model.generator import Generator
from libs.engine.model.loader import build_engine
from libs.protocol.sampling_params import Grammar, SamplingParams
from tests.integration.conftest import start_cluster

MODEL = "SmolLM2-135M-Instruct"
STORY = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper and a storm."}]


def reference(smollm, messages, max_tokens: int, **controls) -> str:
    """What the engine says in one process, greedy, ignoring end-of-sequence."""
    engine = build_engine(smollm, EngineConfig(num_blocks=128, enable_prefix_cache=False))
    prompt = smollm.tokenizer.encode_chat(messages)
    if "response_format" in controls:
        spec = controls.pop("response_format")["json_schema"]
        controls["grammar"] = Grammar(kind="json_schema", schema=json.dumps(spec["schema"]), strict=spec["strict"])
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **controls)
    return Generator(engine, smollm.tokenizer).generate([prompt], params)[0].text


def post(url: str, body: dict) -> HTTPResponse:
    request = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
    return urllib.request.urlopen(request, timeout=120)


def events(response: HTTPResponse) -> Iterator[dict | str]:
    """Each SSE event of a streaming response as it arrives: JSON, or "[DONE]"."""
    for line in response:
        if line.startswith(b"data: "):
            data = line[len(b"data: "):].strip().decode()
            yield data if data == "[DONE]" else json.loads(data)


def text_of(evs: list) -> str:
    chunks = [e for e in evs if isinstance(e, dict) and e.get("choices")]
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in chunks)


def finish_chunk(evs: list) -> dict:
    return next(e for e in evs if isinstance(e, dict) and e.get("choices") and e["choices"][0]["finish_reason"])


def body(max_tokens: int, **controls) -> dict:
    return {"model": MODEL, "messages": STORY, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, **controls}  # fmt: skip


# penalties count every token generated: after the move, those the first decode worker made too
PENALTIES = {"frequency_penalty": 0.6, "presence_penalty": 0.3, "repetition_penalty": 1.2}
# the grammar's state is rebuilt from the tokens generated before the move; the JSON ends (and
# the grammar with it, "stop") well short of max_tokens, ignore_eos or not
STORY_SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string", "maxLength": 32},
                   "events": {"type": "array", "items": {"type": "string", "maxLength": 32}, "minItems": 4,
                              "maxItems": 4}},
    "required": ["title", "events"],
    "additionalProperties": False,
}  # fmt: skip
CONSTRAINED = {"response_format": {"type": "json_schema",
                                   "json_schema": {"name": "story", "schema": STORY_SCHEMA, "strict": True}}}


# a plain request moved off a killed decode worker, its text unchanged, is checked under load in
# tests/reliability/test_restarts.py (the only decode worker killed under 40 streams)
def test_a_decode_worker_killed_mid_stream_hands_the_request_on_and_the_text_is_unchanged(smollm):
    # one cluster for both requests: each kills the decode worker serving it and moves to a survivor
    cluster = start_cluster(prefill=1, decode=3)
    alive = {"decode-0", "decode-1", "decode-2"}
    try:
        for controls, max_tokens in ((PENALTIES, 64), (CONSTRAINED, 160)):
            with post(cluster.gateway_url, body(max_tokens, **controls)) as r:
                assert r.status == 200
                victim = r.headers["x-kvserve-decode-instance"]
                stream = events(r)
                seen = []
                while len([e for e in seen if isinstance(e, dict) and e["choices"][0]["delta"].get("content")]) < 6:
                    seen.append(next(stream))  # a few tokens in: the decode worker holds the request now
                cluster.kill(victim)
                alive.remove(victim)
                seen += list(stream)
            assert seen[-1] == "[DONE]" and not any("error" in e for e in seen if isinstance(e, dict))
            assert text_of(seen) == reference(smollm, STORY, max_tokens, **controls)
            finish = finish_chunk(seen)
            if controls is CONSTRAINED:  # valid JSON, whole
                assert finish["choices"][0]["finish_reason"] == "stop"
                assert set(json.loads(text_of(seen))) == {"title", "events"}
            else:
                assert finish["choices"][0]["finish_reason"] == "length"
            served = finish["kvserve"]
            assert served["prefill_instances"] == ["prefill-0"] and served["migrations"] == 1
            (first, then) = served["decode_instances"]
            assert first == victim and then in alive
    finally:
        cluster.stop()


def test_a_prefill_worker_killed_before_its_first_token_gets_the_request_admitted_elsewhere(smollm):
    # prefill-0 takes requests and never computes them; uncalibrated, equal cost models make
    # the conductor break the tie for the smallest id, so the request lands there.
    env = {"KVSERVE_FAILPOINTS": "prefill-0:prefill.stall_before_compute", "KVSERVE_CALIBRATE": "0"}
    cluster = start_cluster(prefill=2, decode=1, env=env)
    try:
        with post(cluster.gateway_url, body(24)) as r:
            assert r.status == 200 and r.headers["x-kvserve-prefill-instance"] == "prefill-0"
            cluster.kill("prefill-0")  # acknowledged, held, no token sent
            seen = list(events(r))
        assert seen[-1] == "[DONE]"
        assert text_of(seen) == reference(smollm, STORY, 24)
        finish = finish_chunk(seen)
        assert finish["kvserve"] == {"prefill_instances": ["prefill-0", "prefill-1"], "decode_instances": ["decode-0"],
                                     "migrations": 1}  # fmt: skip
    finally:
        cluster.stop()
