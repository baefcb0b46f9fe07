"""The scheduler alone, on a block pool and hand-made logits: exact admissions,
block ids, preemptions and finish reasons."""

import torch

from libs.engine.model.kv_cache import KVCacheManager
from libs.engine.model.scheduler import Scheduler, run_step, sample_tokens, token_stop
from libs.engine.model.sequence import Sequence
from libs.protocol.sampling_params import SamplingParams
from libs.protocol.vocabulary import FinishReason

VOCAB = 16
EOS = 15
BLOCK = 4


def scheduler(num_blocks: int, max_batch_size: int = 8, prefix_cache: bool = False) -> Scheduler:
    cache = KVCacheManager(num_blocks, BLOCK, b"test-model", enable_prefix_cache=prefix_cache)
    return Scheduler(cache, token_stop({EOS}, max_model_len=64), max_batch_size)


def seq(request_id: str, num_tokens: int, **params) -> Sequence:
    params = {"max_tokens": 100, "temperature": 0, **params}
    return Sequence.from_prompt(request_id, list(range(1, num_tokens + 1)), SamplingParams(**params))


def logits_for(*tokens: int) -> torch.Tensor:
    """Logits whose greedy sample is ``tokens`` (one row each)."""
    logits = torch.zeros(len(tokens), VOCAB)
    logits[range(len(tokens)), list(tokens)] = 1.0
    return logits


def computed(sched: Scheduler, batch) -> None:
    """What the engine does to the sequences it ran: blocks for every token, all of them computed."""
    for s in batch.seqs:
        sched.cache.allocate(s, s.num_tokens)
        s.num_computed_tokens = s.num_tokens


def test_admission_leaves_a_block_of_headroom_per_running_sequence():
    sched = scheduler(num_blocks=8)
    a, b, c = seq("a", 10), seq("b", 10), seq("c", 10)
    for s in (a, b, c):
        sched.add(s)
    batch = sched.schedule()
    # a takes 3 blocks; b needs 3 plus one of headroom for a (5 free); c would need 3 + 2 (2 free)
    assert batch.is_prefill and batch.seqs == [a, b]
    assert a.block_table == [0, 1, 2] and b.block_table == [3, 4, 5]
    assert list(sched.waiting) == [c] and c.block_table == []
    computed(sched, batch)
    outputs = sched.update(batch, logits_for(7, 8))
    assert [(o.request_id, o.token_id, o.index, o.finish_reason) for o in outputs] == [
        ("a", 7, 0, None),
        ("b", 8, 0, None),
    ]
    assert sched.running == [a, b]
    decode = sched.schedule()  # c still does not fit: the running pair decodes
    assert not decode.is_prefill and decode.seqs == [a, b]


def test_the_batch_size_caps_admission():
    sched = scheduler(num_blocks=64, max_batch_size=2)
    for name in "abc":
        sched.add(seq(name, 5))
    assert [s.request_id for s in sched.schedule().seqs] == ["a", "b"]


def test_preemption_frees_the_newest_and_it_resumes_with_its_tokens():
    sched = scheduler(num_blocks=4)
    a, b = seq("a", 8), seq("b", 4)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert batch.seqs == [a, b]  # a: blocks 0-1, b: block 2 (b needs 1 + 1 headroom of 2 free)
    assert (a.block_table, b.block_table) == ([0, 1], [2])
    computed(sched, batch)
    sched.update(batch, logits_for(3, 5))  # a has 9 tokens, b 5
    decode = sched.schedule()  # a needs a 3rd block and b a 2nd: 2 needed, 1 free
    assert decode.seqs == [a] and decode.preempted == [b]
    assert b.block_table == [] and b.num_computed_tokens == 0 and list(sched.waiting) == [b]
    assert sched.cache.num_free_blocks == 2
    computed(sched, decode)
    sched.update(decode, logits_for(EOS))  # a stops: its blocks come back
    assert a.finish_reason is FinishReason.STOP and sched.cache.num_free_blocks == 4
    resume = sched.schedule()
    assert resume.is_prefill and resume.seqs == [b] and b.token_ids == [1, 2, 3, 4, 5]  # the prompt and its token
    computed(sched, resume)
    (out,) = sched.update(resume, logits_for(9))
    assert (out.index, b.output_token_ids) == (1, [5, 9])


def test_a_lone_sequence_larger_than_the_pool_is_rejected():
    sched = scheduler(num_blocks=2)
    big, small = seq("big", 9), seq("small", 3)
    sched.add(big)
    sched.add(small)
    batch = sched.schedule()
    assert batch.rejected == [big] and big.finish_reason is FinishReason.ABORT
    assert batch.seqs == [small]
    computed(sched, batch)
    sched.update(batch, logits_for(1))
    for _ in range(5):  # small grows to 9 tokens, 8 of them computed: the whole pool
        step = sched.schedule()
        computed(sched, step)
        sched.update(step, logits_for(1))
    assert small.num_tokens == 9
    last = sched.schedule()  # computing the ninth needs a third block: it can never have one
    assert last.seqs == [] and last.rejected == [small] and small.finish_reason is FinishReason.ABORT
    assert sched.cache.num_free_blocks == 2 and not sched.has_work


def test_abort_frees_the_blocks_of_a_running_or_waiting_sequence():
    sched = scheduler(num_blocks=4)
    a, b = seq("a", 8), seq("b", 8)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert batch.seqs == [a]
    computed(sched, batch)
    sched.update(batch, logits_for(1))
    assert sched.cache.num_free_blocks == 2
    assert sched.abort("a") is a and a.finish_reason is FinishReason.ABORT
    assert sched.cache.num_free_blocks == 4 and sched.running == []
    assert sched.abort("b") is b and not sched.has_work
    assert sched.abort("a") is None


def test_finish_reasons_length_stop_token_and_eos():
    sched = scheduler(num_blocks=16)
    length, stop, eos, ignored = seq("length", 3, max_tokens=2), seq("stop", 3, stop_token_ids=[6]), seq("eos", 3), \
        seq("ignored", 3, ignore_eos=True, max_tokens=1)  # fmt: skip
    for s in (length, stop, eos, ignored):
        sched.add(s)
    batch = sched.schedule()
    computed(sched, batch)
    first = sched.update(batch, logits_for(1, 6, EOS, EOS))
    assert [o.finish_reason for o in first] == [None, FinishReason.STOP, FinishReason.STOP, FinishReason.LENGTH]
    step = sched.schedule()
    assert step.seqs == [length]
    computed(sched, step)
    assert [o.finish_reason for o in sched.update(step, logits_for(2))] == [FinishReason.LENGTH]
    assert sched.cache.num_free_blocks == 16 and not sched.has_work


def test_the_context_window_ends_a_sequence():
    s = seq("edge", 63)
    (out,) = sample_tokens([s], logits_for(1), token_stop({EOS}, max_model_len=64), {EOS})
    assert s.num_tokens == 64 and out.finish_reason is FinishReason.LENGTH


def test_a_prefix_cache_hit_is_admitted_with_its_cached_blocks(tiny_model):
    from libs.engine.model.engine import EngineConfig
    from libs.engine.model.loader import build_engine

    engine = build_engine(tiny_model, EngineConfig(num_blocks=16, block_size=BLOCK))
    sched = Scheduler(engine.cache, token_stop({EOS}, engine.max_model_len))
    first = seq("first", 10, max_tokens=1)
    sched.add(first)
    run_step(engine, sched)
    assert first.is_finished
    again = seq("again", 10, max_tokens=1)
    sched.add(again)
    (out,) = run_step(engine, sched).outputs
    assert again.num_cached_tokens == 8 and out.token_id == first.output_token_ids[0]
