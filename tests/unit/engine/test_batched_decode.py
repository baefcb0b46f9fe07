"""Continuous batching: a sequence's tokens do not depend on its batch-mates."""

from libs.engine.model.engine import EngineConfig
from libs.engine.model.generator import Generator
from libs.engine.model.loader import build_engine
from libs.protocol.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def prompts(loaded) -> list[list[int]]:
    questions = [
        "What is the capital of France?",
        "Write a haiku about rain falling on a quiet city.",
        "List three prime numbers.",
        "Who wrote Hamlet? Answer in one word, then explain the play's plot in detail.",
        "Translate 'good morning' to Spanish.",
        "hi",
        "Describe a cat to someone who has never seen one, using at least five adjectives and one metaphor.",
        "What is 12 times 12? Show the steps.",
    ]
    return [loaded.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in questions]


def test_eight_sequences_of_different_lengths_decode_as_they_do_alone(smollm):
    ps = prompts(smollm)
    assert len({len(p) for p in ps}) == 8
    engine = build_engine(smollm, EngineConfig(num_blocks=256, enable_prefix_cache=False))
    batched = Generator(engine, smollm.tokenizer).generate(ps, PARAMS)
    for p, out in zip(ps, batched):
        alone = Generator(engine, smollm.tokenizer).generate([p], PARAMS)[0]
        assert out.token_ids == alone.token_ids


def test_requests_joining_mid_batch_and_preemption_keep_outputs_exact(tiny_model):
    ps = [list(range(i, i + 20 + 9 * i)) for i in range(8)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    roomy = build_engine(tiny_model, EngineConfig(num_blocks=256, enable_prefix_cache=False))
    expected = [Generator(roomy, tiny_model.tokenizer).generate([p], params)[0].token_ids for p in ps]

    # 24 blocks cannot hold all eight at once: sequences wait, join later, and get preempted
    tight = build_engine(tiny_model, EngineConfig(num_blocks=24, enable_prefix_cache=False))
    generator = Generator(tight, tiny_model.tokenizer, max_batch_size=8)
    seqs = [generator.add_request(p, params) for p in ps]
    batch_sizes = []
    while generator.has_work:
        generator.step()
        batch_sizes.append(len(generator.running))
    assert [s.output_token_ids for s in seqs] == expected
    assert max(batch_sizes) > 1
    assert tight.cache.num_free_blocks == 24
