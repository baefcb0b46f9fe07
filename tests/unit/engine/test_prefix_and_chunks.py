"""Prefix reuse and chunked prefill compute exactly what one full prefill does."""

import torch

from libs.engine.model import steps
from libs.engine.model.engine import EngineConfig
from libs.engine.model.loader import build_engine
from libs.engine.model.sampling import sample
from libs.engine.model.sequence import Sequence
from libs.protocol.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0)


def greedy_continue(engine, seq: Sequence, first_logits: torch.Tensor, n: int) -> list[int]:
    seq.append_token(sample(first_logits[None], [GREEDY], [0])[0])
    for _ in range(n - 1):
        logits = steps.decode(engine, [seq])
        seq.append_token(sample(logits, [GREEDY], [0])[0])
    return seq.output_token_ids


def prompt(loaded, n: int) -> list[int]:
    text = "In a hole in the ground there lived a hobbit. " * 40
    return loaded.tokenizer.encode(text)[:n]


def test_prefill_on_cached_prefix_equals_full_prefill(smollm):
    ids = prompt(smollm, 150)  # 9 full blocks of 16 and a partial one
    reference = build_engine(smollm, EngineConfig(num_blocks=64))
    full = Sequence.from_prompt("full", ids)
    full_logits = steps.prefill_all_logits(reference, [full])[0]
    full_tokens = greedy_continue(reference, full, full_logits[-1], 16)

    engine = build_engine(smollm, EngineConfig(num_blocks=64))
    # the first 96 tokens (6 blocks) computed alone, then the rest on top of their blocks
    head = Sequence.from_prompt("head", ids[:96])
    steps.prefill(engine, [head])
    assert len(head.block_hashes) == 6
    rest = Sequence.from_prompt("rest", ids)
    assert engine.cache.match_prefix(rest) == 96  # found by hash, not recomputed
    assert rest.block_table[:6] == head.block_table
    rest_logits = steps.prefill_all_logits(engine, [rest])[0]
    assert rest_logits.shape[0] == len(ids) - 96
    assert (rest_logits - full_logits[96:]).abs().max().item() < 1e-4
    assert greedy_continue(engine, rest, rest_logits[-1], 16) == full_tokens


def test_chunked_prefill_equals_unchunked(smollm):
    ids = prompt(smollm, 300)
    one = build_engine(smollm, EngineConfig(num_blocks=64, max_chunk_tokens=4096, enable_prefix_cache=False))
    chunked = build_engine(smollm, EngineConfig(num_blocks=64, max_chunk_tokens=37, enable_prefix_cache=False))
    a, b = Sequence.from_prompt("a", ids), Sequence.from_prompt("b", ids)
    logits_a = steps.prefill_all_logits(one, [a])[0]
    logits_b = steps.prefill_all_logits(chunked, [b])[0]
    assert (logits_a - logits_b).abs().max().item() < 1e-4
    assert greedy_continue(one, a, logits_a[-1], 12) == greedy_continue(chunked, b, logits_b[-1], 12)


def test_packed_prefill_of_several_sequences_equals_each_alone(tiny_model):
    engine = build_engine(tiny_model, EngineConfig(num_blocks=128, max_chunk_tokens=50, enable_prefix_cache=False))
    prompts = [list(range(i, i + n)) for i, n in ((0, 7), (3, 40), (9, 16), (1, 75))]
    together = steps.prefill(engine, [Sequence.from_prompt(str(i), p) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        alone = steps.prefill(engine, [Sequence.from_prompt(f"alone{i}", p)])
        assert (together[i] - alone[0]).abs().max().item() < 1e-5


def test_a_long_prompt_cut_into_steps_between_other_prompts_equals_its_unchunked_prefill(smollm):
    """What a prefill worker does: a long prompt computed a step at a time, its KV kept
    between steps while short prompts are computed in steps of their own (or share one)."""
    ids = prompt(smollm, 300)
    whole = build_engine(smollm, EngineConfig(num_blocks=64, max_chunk_tokens=4096, enable_prefix_cache=False))
    reference = Sequence.from_prompt("ref", ids)
    expected = steps.prefill(whole, [reference])

    engine = build_engine(smollm, EngineConfig(num_blocks=64, max_chunk_tokens=4096, enable_prefix_cache=False))
    long = Sequence.from_prompt("long", ids)
    short = [Sequence.from_prompt(f"s{i}", prompt(smollm, 20 + i)) for i in range(3)]
    steps.allocate(engine, [long, *short])  # the caller's job: the engine only computes
    assert engine.prefill_chunk([(long, 100)]) is None  # not done: no logits, its KV kept
    short_logits = engine.prefill_chunk([(short[0], short[0].num_tokens)])  # a newcomer goes between
    assert engine.prefill_chunk([(long, 128)]) is None
    both = engine.prefill_chunk([(short[1], short[1].num_tokens), (long, 72)])  # a step shared with another
    assert both.shape[0] == 2 and long.num_computed_tokens == 300
    assert (both[1:] - expected).abs().max().item() < 1e-4
    assert greedy_continue(engine, long, both[1], 12) == greedy_continue(whole, reference, expected[0], 12)
    alone = build_engine(smollm, EngineConfig(num_blocks=64, enable_prefix_cache=False))
    assert (short_logits - steps.prefill(alone, [Sequence.from_prompt("a", short[0].prompt_token_ids)])).abs().max().item() < 1e-4
