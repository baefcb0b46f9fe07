"""Warming a window's history: exactly the prefixes the window shares with the
trace before it are sent, once each, before the run, and the run counts them."""

import asyncio

from kvserve.replay import history
from kvserve.replay.client import Endpoint, plan
from kvserve.replay.prompts import PromptSynthesizer
from kvserve.replay.trace import TraceRequest
from tests.unit.replay import fake_openai
from tests.unit.replay.fake_openai import FakeServer, Script

VOCAB = list(range(17, 4000))


def request(index: int, *hash_ids: int) -> TraceRequest:
    return TraceRequest(index, timestamp_ms=index * 100, input_length=512 * len(hash_ids), output_length=4,
                        hash_ids=tuple(hash_ids))  # fmt: skip


HISTORY = [request(0, 1, 2, 3, 4), request(1, 1, 2, 9), request(2, 5, 6)]


def test_longest_shared_prefix_per_request_without_duplicates_or_contained_ones():
    synth = PromptSynthesizer(VOCAB, block_tokens=8)
    window = [
        request(3, 1, 2, 3, 7),  # shares 1 2 3
        request(4, 1, 2, 8),  # shares 1 2: contained in 1 2 3, not sent on its own
        request(5, 1, 2, 3, 4, 5),  # shares 1 2 3 4
        request(6, 5, 6, 7),  # shares 5 6
        request(7, 5, 6, 8),  # the same prefix again
        request(8, 2, 3),  # 2 3 follows 1 in the history, never starts a prompt: nothing
        request(9, 9),  # 9 is in the history only after 1 2: nothing
    ]
    assert history.shared_prefixes(HISTORY, window, synth) == [(1, 2, 3, 4), (5, 6)]
    assert history.shared_prefixes([], window, synth) == []


def test_only_blocks_the_prompts_keep_are_shared():
    synth = PromptSynthesizer(VOCAB, block_tokens=8, max_input=16)  # two blocks a prompt
    window = [request(3, 1, 2, 3, 4)]
    assert history.shared_prefixes(HISTORY, window, synth) == [(1, 2)]


def test_plan_counts_warmed_blocks_as_sent():
    synth = PromptSynthesizer(VOCAB, block_tokens=8)
    window = [request(3, 1, 2, 3, 7), request(4, 1, 2, 3, 7, 8)]
    cold = plan(window, synth, 1.0)
    warmed = plan(window, synth, 1.0, warmed=history.shared_prefixes(HISTORY, window, synth))
    assert [p.record.cached_blocks_expected for p in cold] == [0, 4]
    assert [p.record.cached_blocks_expected for p in warmed] == [3, 4]


async def test_warm_sends_each_prefix_as_its_blocks_one_at_a_time_for_one_token():
    synth = PromptSynthesizer(VOCAB, block_tokens=8, seed=3)
    hold = asyncio.Event()
    first = synth.block(1)[0]
    server = FakeServer({first: Script(hold=hold)}, default=Script())
    runner, url = await fake_openai.start(server)
    try:
        warming = asyncio.create_task(history.warm(Endpoint(url, "m", "k"), [(1, 2), (5,)], synth))
        await server.event(first).wait()
        assert len(server.bodies) == 1  # the second waits for the first to finish
        hold.set()
        done = await warming
    finally:
        await runner.cleanup()
    assert [b["prompt"] for b in server.bodies] == [synth.block(1) + synth.block(2), synth.block(5)]
    assert all(b["max_tokens"] == 1 for b in server.bodies)
    assert (done.prompts, done.tokens, done.failed) == (2, 24, 0)


async def test_a_refused_warming_prompt_is_counted_as_failed():
    synth = PromptSynthesizer(VOCAB, block_tokens=8)
    server = FakeServer({synth.block(5)[0]: Script(status=429)}, default=Script())
    runner, url = await fake_openai.start(server)
    try:
        done = await history.warm(Endpoint(url, "m"), [(1,), (5,)], synth)
    finally:
        await runner.cleanup()
    assert (done.prompts, done.failed) == (2, 1)
