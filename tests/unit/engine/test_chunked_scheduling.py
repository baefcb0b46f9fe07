"""Chunked prefill in the scheduler: while a batch decodes, a long prompt is prefilled
a chunk per step, decode steps running between its chunks, with the tokens of an
unchunked run."""

from libs.engine.model.engine import EngineConfig
from libs.engine.model.generator import Generator
from libs.engine.model.loader import build_engine
from libs.protocol.sampling_params import SamplingParams
from tests.unit.engine.test_scheduler import BLOCK, logits_for, scheduler, seq


def ran(batch) -> tuple:
    """What a step runs: ("prefill", completed ids, chunk) or ("decode", ids); and the engine's
    effect on its sequences (every token computed, or the chunk's)."""
    if batch.chunk is not None:
        chunk_seq, n = batch.chunk
        chunk_seq.num_computed_tokens += n
    for s in batch.seqs:
        s.num_computed_tokens = s.num_tokens
    ids = [s.request_id for s in batch.seqs]
    if batch.is_prefill:
        return "prefill", ids, None if batch.chunk is None else (batch.chunk[0].request_id, batch.chunk[1])
    return "decode", ids


def step(sched, max_chunk_tokens: int):
    """One scheduler step, the engine's part played by ``ran``, every sequence sampling
    token 1: the batch and what ``ran`` says it did."""
    batch = sched.schedule(max_chunk_tokens=max_chunk_tokens)
    what = ran(batch)
    if batch.seqs:
        sched.update(batch, logits_for(*[1] * len(batch.seqs)))
    return batch, what


def test_a_long_prompt_is_prefilled_a_chunk_a_step_between_decode_steps():
    sched = scheduler(num_blocks=16)
    a, b = seq("a", 3), seq("b", 10)
    sched.add(a)
    first = sched.schedule(max_chunk_tokens=4)  # nothing decodes: a whole prefill
    assert ran(first) == ("prefill", ["a"], None)
    sched.update(first, logits_for(1))
    sched.add(b)
    steps = []
    for _ in range(6):
        batch, what = step(sched, 4)
        steps.append(what)
        if batch.chunk is not None:
            assert list(sched.waiting) == [b] and sched.partial is b  # waiting, its blocks held
            assert b.block_table == [1, 2, 3]  # all of them, from its first chunk on
    assert steps == [
        ("prefill", [], ("b", 4)), ("decode", ["a"]),
        ("prefill", [], ("b", 4)), ("decode", ["a"]),
        ("prefill", ["b"], None), ("decode", ["a", "b"]),  # its last 2 tokens: it completes
    ]  # fmt: skip
    assert sched.partial is None and sched.running == [a, b] and len(a.output_token_ids) == 4


def test_short_prompts_share_a_chunk_step_and_the_rest_waits_whole():
    sched = scheduler(num_blocks=16)
    a = seq("a", 3)
    sched.add(a)
    sched.update(sched.schedule(max_chunk_tokens=6), logits_for(1))
    short, long_ = seq("short", 2), seq("long", 9)
    sched.add(short)
    sched.add(long_)
    batch = sched.schedule(max_chunk_tokens=6)
    assert (batch.seqs, batch.chunk) == ([short], (long_, 4))  # 2 + 4 tokens: the budget


def test_aborting_a_partly_prefilled_sequence_frees_its_blocks():
    sched = scheduler(num_blocks=8)
    a, b = seq("a", 3), seq("b", 3 * BLOCK)
    sched.add(a)
    sched.update(sched.schedule(max_chunk_tokens=4), logits_for(1))
    sched.add(b)
    ran(sched.schedule(max_chunk_tokens=4))
    assert sched.partial is b and sched.cache.num_free_blocks == 8 - 1 - 3
    assert sched.abort("b") is b
    assert sched.partial is None and list(sched.waiting) == [] and sched.cache.num_free_blocks == 7


def _run(tiny_model, max_chunk_tokens: int) -> tuple[list[list[int]], list[str]]:
    """A decodes; B (a long prompt) arrives: both outputs, and what each step did while B
    was in prefill ("decode": A got a token; "chunk": B's prompt advanced)."""
    engine = build_engine(tiny_model, EngineConfig(num_blocks=64, max_chunk_tokens=max_chunk_tokens,
                                                   enable_prefix_cache=False))  # fmt: skip
    generator = Generator(engine, tiny_model.tokenizer)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    a = generator.add_request(list(range(3, 14)), params)
    generator.step()  # A's prefill: A decodes from here on
    b = generator.add_request([(7 * i) % 200 + 3 for i in range(40)], params)
    steps = []
    while b not in generator.running:
        before = (len(a.output_token_ids), b.num_computed_tokens)
        generator.step()
        if b.num_computed_tokens > before[1]:
            steps.append("chunk")
        if len(a.output_token_ids) > before[0]:
            steps.append("decode")
    while generator.has_work:
        generator.step()
    return [a.output_token_ids, b.output_token_ids], steps


def test_decode_steps_run_between_a_long_prompt_s_chunks_with_the_unchunked_tokens(tiny_model):
    unchunked, whole = _run(tiny_model, max_chunk_tokens=512)
    chunked, steps = _run(tiny_model, max_chunk_tokens=8)
    assert whole == ["chunk"]  # the batch stalled for the whole prompt at once
    assert steps == ["chunk", "decode"] * 4 + ["chunk"]  # 40 tokens: 8 at a time, A decoding between
    assert chunked == unchunked


def test_a_sequence_preempted_while_another_is_partly_prefilled_queues_behind_it():
    """The partly prefilled sequence holds its blocks at the head of the queue: a decode
    step's victim must not jump ahead of it (it would take the partial's place, and the
    partial would later be admitted again as if new, over the blocks it holds: an
    AssertionError in the cache, or with nothing running a step that never moves)."""
    sched = scheduler(num_blocks=10, max_batch_size=4)
    a, c, b = seq("a", 3, max_tokens=30), seq("c", 3, max_tokens=30), seq("b", 6 * BLOCK, max_tokens=2)
    for s in (a, c):
        sched.add(s)
    first = sched.schedule(max_chunk_tokens=2)
    ran(first)
    sched.update(first, logits_for(1, 1))
    sched.add(b)
    preempted_while_partial = False
    for _ in range(200):
        batch = sched.schedule(max_chunk_tokens=2)
        if batch.preempted and sched.partial is not None:
            preempted_while_partial = True
        if sched.partial is not None:
            assert sched.waiting[0] is sched.partial
        ran(batch)
        for s in batch.seqs if not batch.is_prefill else []:  # the engine's part: blocks for the new token
            sched.cache.allocate(s, s.num_tokens)
        if batch.seqs:
            sched.update(batch, logits_for(*[1] * len(batch.seqs)))
        if not sched.has_work:
            break
    assert preempted_while_partial  # the case this test is about happened
    assert not sched.has_work and all(s.finish_reason is not None for s in (a, b, c))
    assert sched.cache.num_free_blocks == 10


def test_a_step_whose_budget_runs_out_exactly_leaves_the_next_prompt_untouched():
    """Prompts that use up a chunk step's budget exactly: the next one in line must not
    be given blocks it is not then prefilled into (it would be admitted again over them
    next step: an AssertionError in the cache that killed the decode worker's loop)."""
    sched = scheduler(num_blocks=16)
    a = seq("a", 3, max_tokens=30)
    sched.add(a)
    sched.update(sched.schedule(max_chunk_tokens=4), logits_for(1))
    exact, nxt = seq("exact", 4), seq("next", 5)
    sched.add(exact)
    sched.add(nxt)
    free = sched.cache.num_free_blocks
    batch = sched.schedule(max_chunk_tokens=4)
    assert ran(batch) == ("prefill", ["exact"], None)
    assert nxt.block_table == [] and sched.partial is None and list(sched.waiting) == [nxt]
    assert sched.cache.num_free_blocks == free - 1  # exact's one block, none for next
    sched.update(batch, logits_for(1))
    steps = [step(sched, 4)[1] for _ in range(4)]
    assert steps == [("decode", ["a", "exact"]), ("prefill", [], ("next", 4)), ("decode", ["a", "exact"]),
                     ("prefill", ["next"], None)]  # fmt: skip


def test_prompts_with_a_due_are_chunked_in_deadline_order_so_a_short_one_passes_a_long_one():
    from libs.engine.model.scheduler import Due

    sched = scheduler(num_blocks=16)
    sched.prefill_time = lambda s: 1e-3 * (s.num_tokens - s.num_computed_tokens)
    long, short = seq("long", 40), seq("short", 4)
    sched.add(long, Due(deadline=10.0, arrived=0.0))
    batch = sched.schedule(max_chunk_tokens=8, now=0.0)  # nothing decodes, but it is cut all the same
    assert ran(batch) == ("prefill", [], ("long", 8)) and sched.partial is long
    sched.add(short, Due(deadline=10.0, arrived=1.0))
    batch = sched.schedule(max_chunk_tokens=8, now=1.0)
    # the short one first, whole, then the long one's next chunk with what is left of the step
    assert ran(batch) == ("prefill", ["short"], ("long", 4))
    sched.update(batch, logits_for(1))
    assert sched.running == [short] and sched.partial is long
    # a long one whose deadline only the order keeps goes first: a 30-token prompt due in 0.04 s
    urgent = seq("urgent", 30)
    sched.add(urgent, Due(deadline=1.05, arrived=1.0))
    assert [s.request_id for s in sched.waiting] == ["long", "urgent"]


def test_without_a_due_a_prompt_alone_is_prefilled_whole_as_before():
    sched = scheduler(num_blocks=16)
    sched.add(seq("a", 40))
    assert ran(sched.schedule(max_chunk_tokens=8)) == ("prefill", ["a"], None)
