"""Prompt synthesis reproduces the trace's sharing: equal hash ids <-> equal
token blocks, and every prompt has exactly its (scaled) input length."""

import math
from pathlib import Path

import pytest

from kvserve.replay.prompts import PromptSynthesizer
from kvserve.replay.trace import TraceRequest, load_trace

TRACE = Path(__file__).resolve().parents[3].parent / "shared" / "traces" / "conversation_trace.jsonl"
VOCAB = list(range(17, 49152))
VOCAB_SET = set(VOCAB)


@pytest.fixture(scope="module")
def window() -> list[TraceRequest]:
    if not TRACE.exists():
        pytest.skip(f"the shared trace is not at {TRACE}")
    return load_trace(TRACE, max_requests=300)


def blocks_by_hash(synth: PromptSynthesizer, requests: list[TraceRequest]) -> dict[int, set[tuple[int, ...]]]:
    """Every token block each hash id became, across all the prompts it appears in."""
    seen: dict[int, set[tuple[int, ...]]] = {}
    bt = synth.block_tokens
    for request in requests:
        prompt = synth.prompt(request)
        for i, hash_id in enumerate(request.hash_ids[: synth.num_shared_blocks(request)]):
            seen.setdefault(hash_id, set()).add(tuple(prompt[i * bt : (i + 1) * bt]))
    return seen


@pytest.mark.parametrize("block_tokens", [8, 16])
def test_equal_hash_ids_give_equal_blocks_and_distinct_ids_distinct_blocks(window, block_tokens):
    synth = PromptSynthesizer(VOCAB, block_tokens=block_tokens, seed=3)
    seen = blocks_by_hash(synth, window)
    assert all(len(blocks) == 1 for blocks in seen.values())  # one block per id, in every prompt
    distinct = {next(iter(blocks)) for blocks in seen.values()}
    assert len(distinct) == len(seen)  # and no two ids share one
    shared = [h for h in seen if sum(h in r.hash_ids for r in window) > 1]
    assert len(shared) > 10  # the window really has sharing to reproduce


def test_shared_prefixes_are_exactly_the_traces(window):
    synth = PromptSynthesizer(VOCAB, block_tokens=16, seed=0)
    a, b = window[0], next(r for r in window[1:] if r.hash_ids[0] == window[0].hash_ids[0])
    common = next(i for i, (x, y) in enumerate(zip(a.hash_ids, b.hash_ids)) if x != y)
    pa, pb = synth.prompt(a), synth.prompt(b)
    assert pa[: common * 16] == pb[: common * 16]
    assert pa[common * 16 : (common + 1) * 16] != pb[common * 16 : (common + 1) * 16]


@pytest.mark.parametrize("max_input", [None, 100, 1000])
def test_input_lengths_are_exact(window, max_input):
    synth = PromptSynthesizer(VOCAB, block_tokens=16, seed=0, max_input=max_input)
    for request in window:
        scaled = max(1, math.floor(request.input_length * 16 / 512 + 0.5))  # half up
        expected = scaled if max_input is None else min(scaled, max_input)
        prompt = synth.prompt(request)
        assert len(prompt) == synth.input_length(request) == expected
        assert set(prompt) <= VOCAB_SET


def test_truncation_keeps_every_kept_block_and_the_sharing(window):
    full = PromptSynthesizer(VOCAB, block_tokens=16, seed=5)
    capped = PromptSynthesizer(VOCAB, block_tokens=16, seed=5, max_input=100)
    for request in window:
        kept = capped.num_shared_blocks(request)
        assert kept == min(100 // 16, full.num_shared_blocks(request))
        assert capped.prompt(request)[: kept * 16] == full.prompt(request)[: kept * 16]
    assert all(len(blocks) == 1 for blocks in blocks_by_hash(capped, window).values())


def test_partial_block_is_the_requests_own():
    synth = PromptSynthesizer(VOCAB, block_tokens=16, seed=0)
    # same hash ids, same length (2 full blocks + 8 tokens), different requests
    a = TraceRequest(index=1, timestamp_ms=0, input_length=1280, output_length=4, hash_ids=(5, 6, 7))
    b = TraceRequest(index=2, timestamp_ms=0, input_length=1280, output_length=4, hash_ids=(5, 6, 7))
    pa, pb = synth.prompt(a), synth.prompt(b)
    assert len(pa) == len(pb) == 40
    assert pa[:32] == pb[:32] == synth.block(5) + synth.block(6)
    assert pa[32:] != pb[32:]
    assert synth.prompt(a) == PromptSynthesizer(VOCAB, block_tokens=16, seed=0).prompt(a)  # deterministic


def test_seed_changes_tokens_not_structure():
    a, b = PromptSynthesizer(VOCAB, seed=0), PromptSynthesizer(VOCAB, seed=1)
    assert a.block(42) != b.block(42)
    assert len(a.block(42)) == len(b.block(42)) == 16


def test_output_length_is_capped_and_at_least_one():
    synth = PromptSynthesizer(VOCAB, max_output=32)
    long = TraceRequest(0, 0, 10, 500, (1,))
    empty = TraceRequest(1, 0, 10, 0, (1,))
    assert (synth.output_length(long), synth.output_length(empty)) == (32, 1)
