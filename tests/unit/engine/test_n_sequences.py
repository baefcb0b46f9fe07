"""A request for n sequences: its prompt is prefilled once, the other n - 1 sequences
fork from it sharing the prompt's full KV blocks, each with a copy of the partly
filled last block (copy on write), and each then decodes as the first would."""

import pytest
import torch

from libs.engine.model import steps
from libs.engine.model.engine import EngineConfig
from libs.engine.model.generator import Generator
from libs.engine.model.kv_cache import KVCacheManager
from libs.engine.model.loader import build_engine
from libs.engine.model.sequence import Sequence
from libs.protocol.sampling_params import SamplingParams

BLOCK = 4


def prefilled(cache: KVCacheManager, num_tokens: int) -> Sequence:
    seq = Sequence.from_prompt("r", list(range(num_tokens)), SamplingParams(n=3))
    cache.allocate(seq, num_tokens)
    seq.num_computed_tokens = num_tokens
    cache.cache_full_blocks(seq)
    return seq


def test_a_fork_shares_the_full_blocks_and_copies_the_partial_one():
    cache = KVCacheManager(8, BLOCK, b"m")
    seq = prefilled(cache, 10)  # blocks 0, 1 full; block 2 holds 2 tokens
    sibling, copy = cache.fork(seq, choice=1)
    assert (sibling.block_table, copy, sibling.choice, sibling.block_hashes) == ([0, 1, 3], (2, 3), 1, seq.block_hashes)
    assert [cache.block_pool.blocks[b].ref_count for b in range(4)] == [2, 2, 1, 1]
    assert cache.num_free_blocks == 4
    sibling.append_token(99)
    assert seq.token_ids == list(range(10))  # its own tokens
    cache.free(seq)
    cache.free(sibling)
    assert cache.num_free_blocks == 8


def test_a_prompt_of_whole_blocks_is_shared_whole():
    cache = KVCacheManager(8, BLOCK, b"m")
    seq = prefilled(cache, 8)
    sibling, copy = cache.fork(seq, choice=2)
    assert (sibling.block_table, copy, cache.num_free_blocks) == ([0, 1], None, 6)


def test_only_a_sequence_whose_blocks_hold_its_computed_kv_forks():
    cache = KVCacheManager(8, BLOCK, b"m")
    seq = prefilled(cache, 10)
    seq.append_token(5)
    cache.allocate(seq, 12)  # room for a token not computed yet
    seq.token_ids += [6]
    cache.allocate(seq, 13)
    with pytest.raises(ValueError, match="only a sequence"):
        cache.fork(seq, choice=1)


def test_the_engine_copies_the_partial_blocks_kv(tiny_model):
    engine = build_engine(tiny_model, EngineConfig(num_blocks=16, block_size=BLOCK))
    seq = Sequence.from_prompt("r", [5, 6, 7, 8, 9, 10], SamplingParams(n=2))
    steps.prefill(engine, [seq])
    sibling = engine.fork(seq, choice=1)
    assert sibling.block_table[0] == seq.block_table[0] and sibling.block_table[1] != seq.block_table[1]
    assert torch.equal(engine.pool.kv[sibling.block_table[1]], engine.pool.kv[seq.block_table[1]])


def test_n_greedy_sequences_are_the_one_sequence_and_the_prompt_is_prefilled_once(tiny_model):
    prompt = [5, 9, 14, 9, 5, 30, 31, 40, 41, 42]  # two full blocks and two tokens
    engine = build_engine(tiny_model, EngineConfig(num_blocks=32, block_size=BLOCK, enable_prefix_cache=False))
    alone = Generator(engine, tiny_model.tokenizer).generate([prompt], SamplingParams(max_tokens=8, temperature=0,
                                                                                        ignore_eos=True))  # fmt: skip
    generator = Generator(engine, tiny_model.tokenizer)
    params = SamplingParams(n=3, max_tokens=8, temperature=0, ignore_eos=True)
    seq = generator.add_request(prompt, params)
    first = generator.step()  # the prefill: one prompt computed, three first tokens
    assert [out.choice for out in first] == [0, 1, 2]
    assert engine.cache.num_blocks - engine.cache.num_free_blocks == 3 + 2  # the prompt's 3 blocks + 2 copies
    assert seq.block_table[:2] == generator.choices(seq.request_id)[1].block_table[:2]
    while generator.has_work:
        generator.step()
    outputs = [s.output_token_ids for s in generator.choices(seq.request_id)]
    assert outputs == [alone[0].token_ids] * 3


def test_n_sampled_sequences_draw_apart_and_the_first_draws_as_alone(tiny_model):
    engine = build_engine(tiny_model, EngineConfig(num_blocks=64, block_size=BLOCK))
    prompt = [5, 9, 14, 9, 5]
    params = SamplingParams(max_tokens=12, temperature=1.5, seed=3, ignore_eos=True)
    alone = Generator(engine, tiny_model.tokenizer).generate([prompt], params)
    many = Generator(engine, tiny_model.tokenizer).generate([prompt], SamplingParams(**{
        **{f: getattr(params, f) for f in params.__struct_fields__}, "n": 3}))  # fmt: skip
    assert [c.choice for c in many] == [0, 1, 2]
    assert many[0].token_ids == alone[0].token_ids
    assert len({tuple(c.token_ids) for c in many}) == 3


def test_aborting_a_request_ends_all_its_sequences(tiny_model):
    engine = build_engine(tiny_model, EngineConfig(num_blocks=32, block_size=BLOCK))
    generator = Generator(engine, tiny_model.tokenizer)
    seq = generator.add_request([5, 9, 14, 9, 5], SamplingParams(n=4, max_tokens=20, temperature=0))
    generator.step()
    generator.abort(seq.request_id)
    assert [s.is_finished for s in generator.choices(seq.request_id)] == [True] * 4
    assert engine.cache.num_free_blocks == engine.cache.num_blocks and not generator.has_work
