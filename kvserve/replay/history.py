"""A window's history: the prefixes a trace window shares with the trace's
requests before it, and sending them so a run starts from the prefix cache a
server would hold after serving the trace up to the window.

A window taken from the start of a trace meets a cold cache: the first minute of
the conversation trace has 4% reusable prompt tokens, its middle a third, because
a conversation's later turns reuse what its earlier turns, minutes before, sent.
Warming sends, one at a time and for one output token each, one prompt per
maximal shared prefix (made of its hash-id blocks only, as ``PromptSynthesizer``
makes them with the run's seed), so every cache the server has can hold it;
nothing of the window itself is sent. Nothing here computes statistics.
"""

import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from kvserve.replay.client import Endpoint, PlannedRequest, send
from kvserve.replay.prompts import PromptSynthesizer
from kvserve.replay.records import RequestRecord
from kvserve.replay.trace import TraceRequest, load_trace

NO_HISTORY = "--warm-history warms what the window shares with the requests before --start: give --start"


def load_history(path, start: int) -> list[TraceRequest]:
    """The trace's requests before ``start``: what ``--warm-history`` warms from; a
    ValueError (``NO_HISTORY``) when there are none."""
    if start == 0:
        raise ValueError(NO_HISTORY)
    return load_trace(path, start)


def shared_prefixes(
    history: Sequence[TraceRequest], window: Sequence[TraceRequest], synth: PromptSynthesizer
) -> list[tuple[int, ...]]:
    """The hash-id prefixes a window's prompts share with ``history``'s, longest
    per window request, without duplicates or prefixes of another one (sending the
    longer caches the shorter), in sorted order."""
    children: dict[tuple[int, int], int] = {}  # a trie of the history's kept blocks: (node, hash id) -> node
    for request in history:
        node = 0
        for hash_id in request.hash_ids[: synth.num_shared_blocks(request)]:
            node = children.setdefault((node, hash_id), len(children) + 1)
    found = set()
    for request in window:
        node, depth = 0, 0
        for hash_id in request.hash_ids[: synth.num_shared_blocks(request)]:
            node = children.get((node, hash_id))
            if node is None:
                break
            depth += 1
        if depth:
            found.add(request.hash_ids[:depth])
    ordered = sorted(found)
    # in sorted order a prefix of any other comes right before one it prefixes
    return [p for p, after in zip(ordered, ordered[1:] + [()]) if after[: len(p)] != p]


@dataclass(frozen=True)
class Warming:
    prompts: int
    tokens: int
    failed: int
    seconds: float

    def to_json(self) -> dict[str, float]:
        return {"warm_prompts": self.prompts, "warm_tokens": self.tokens, "warm_failed": self.failed,
                "warm_seconds": round(self.seconds, 3)}  # fmt: skip


async def warm(endpoint: Endpoint, prefixes: Sequence[tuple[int, ...]], synth: PromptSynthesizer) -> Warming:
    """Send each prefix as a prompt of its blocks, one at a time, for one token."""
    timeout = aiohttp.ClientTimeout(total=endpoint.timeout_s)
    headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
    failed = tokens = 0
    start = time.perf_counter()
    async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
        for i, prefix in enumerate(prefixes):
            prompt = [token for hash_id in prefix for token in synth.block(hash_id)]
            item = PlannedRequest(prompt, RequestRecord(index=-1 - i, scheduled_s=0.0, input_tokens=len(prompt),
                                                        max_tokens=1))  # fmt: skip
            await send(session, endpoint, item, time.perf_counter())
            failed += item.record.status != "ok"
            tokens += len(prompt)
    return Warming(len(prefixes), tokens, failed, time.perf_counter() - start)
