"""The compiled decode step computes what the eager one does, for any batch, and never
recompiles once warmed up."""

import pytest
import torch

from libs.engine.model import steps
from libs.engine.model.compiled import CompiledDecode
from libs.engine.model.engine import EngineConfig
from libs.engine.model.loader import build_engine
from libs.engine.model.sequence import Sequence

NUM_BLOCKS = 512


@pytest.fixture(scope="module")
def engines(tiny_model):
    """A compiled engine (warmed up once for the module) and an eager twin of the same shape."""
    compiled = build_engine(tiny_model, EngineConfig(num_blocks=NUM_BLOCKS, enable_prefix_cache=True, compile=True))
    compiled.warmup()
    eager = build_engine(tiny_model, EngineConfig(num_blocks=NUM_BLOCKS, enable_prefix_cache=True, compile=False))
    return compiled, eager


@pytest.fixture
def strict(monkeypatch):
    """Any guard failing after warm-up raises instead of quietly running eagerly."""
    monkeypatch.setattr(CompiledDecode, "stance", "fail_on_recompile")
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    yield
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames  # nothing compiled since warm-up
    assert not torch._dynamo.utils.counters["graph_break"]


def prompt(i: int) -> list[int]:
    return [(7 * i + 3 * j) % 250 for j in range(5 + 11 * i % 97)]  # lengths 5..101, all different


def decode(engine, seqs: list[Sequence], num_steps: int) -> list[torch.Tensor]:
    """Greedy decode steps over ``seqs`` (prefilled if new); the logits of each step."""
    fresh = [s for s in seqs if s.num_computed_tokens < s.num_tokens - 1]
    if fresh:
        for s, logits in zip(fresh, steps.prefill(engine, fresh)):
            s.append_token(int(logits.argmax()))
    out = []
    for _ in range(num_steps):
        logits = steps.decode(engine, seqs)
        out.append(logits)
        for s, row in zip(seqs, logits):
            s.append_token(int(row.argmax()))
    return out


def free(engine, seqs: list[Sequence]) -> None:
    for s in seqs:
        engine.cache.free(s)


@pytest.mark.parametrize("batch", [1, 3, 8, 33])
def test_compiled_equals_eager_for_batches_of_different_lengths(engines, strict, batch):
    compiled, eager = engines
    runs = {}
    for name, engine in (("compiled", compiled), ("eager", eager)):
        seqs = [Sequence.from_prompt(f"{name}{i}", prompt(i)) for i in range(batch)]
        runs[name] = (decode(engine, seqs, 6), [s.output_token_ids for s in seqs])
        free(engine, seqs)
    assert runs["compiled"][1] == runs["eager"][1]
    for a, b in zip(runs["compiled"][0], runs["eager"][0]):
        assert a.shape == (batch, compiled.model.config.vocab_size)
        assert (a - b).abs().max().item() < 1e-4


def test_a_growing_batch_crosses_sizes_without_recompiling(engines, strict):
    compiled, eager = engines
    tokens = {}
    for name, engine in (("compiled", compiled), ("eager", eager)):
        seqs: list[Sequence] = []
        for size in (3, 5, 9, 17, 2):
            if size < len(seqs):
                free(engine, seqs[size:])
                del seqs[size:]
            seqs += [Sequence.from_prompt(f"{name}{i}", prompt(40 + i)) for i in range(len(seqs), size)]
            decode(engine, seqs, 3)
        tokens[name] = [s.output_token_ids for s in seqs]
        free(engine, seqs)
    assert tokens["compiled"] == tokens["eager"]


def test_prefix_cached_and_preempted_sequences(engines, strict):
    compiled, eager = engines
    tokens = {}
    for name, engine in (("compiled", compiled), ("eager", eager)):
        shared = prompt(60)[:48]
        head = Sequence.from_prompt(f"{name}-head", shared)
        steps.prefill(engine, [head])
        cached = Sequence.from_prompt(f"{name}-cached", shared + [9, 8, 7])
        assert engine.cache.match_prefix(cached) == 48  # three full blocks found by hash
        other = Sequence.from_prompt(f"{name}-other", prompt(61))
        seqs = [cached, other]
        decode(engine, seqs, 4)
        # preempt `other`: its blocks go back, and it is recomputed from all its tokens
        engine.cache.free(other)
        other.num_computed_tokens = other.num_cached_tokens = 0
        other.block_hashes = []
        other.append_token(int(steps.prefill(engine, [other])[0].argmax()))
        decode(engine, seqs, 4)
        tokens[name] = [s.output_token_ids for s in seqs]
        free(engine, [head, *seqs])
    assert tokens["compiled"] == tokens["eager"]


def test_padding_writes_no_byte_but_the_real_rows_slots(engines, strict):
    compiled, _ = engines
    seq = Sequence.from_prompt("alone", prompt(5))
    decode(compiled, [seq], 1)
    before = compiled.pool.kv.clone()
    decode(compiled, [seq], 1)  # one row, padded to two for the graph
    changed = (compiled.pool.kv != before).flatten(2).any(-1)  # [blocks, layers]
    position = seq.num_tokens - 2  # the token this step computed
    block = seq.block_table[position // compiled.block_size]
    assert changed.any(1).nonzero().flatten().tolist() == [block]
    slot_changed = (compiled.pool.kv[block] != before[block]).flatten(3).any(-1).any(0).any(0)  # [block_size]
    assert slot_changed.nonzero().flatten().tolist() == [position % compiled.block_size]
    free(compiled, [seq])


def test_kvserve_compile_0_gives_the_eager_path(tiny_model, monkeypatch):
    monkeypatch.setenv("KVSERVE_COMPILE", "0")
    engine = build_engine(tiny_model, EngineConfig(num_blocks=8))
    assert engine.compiled is None
    engine.warmup()  # nothing to do
    seq = Sequence.from_prompt("a", [1, 2, 3])
    assert decode(engine, [seq], 1)[0].shape == (1, tiny_model.model.config.vocab_size)
    monkeypatch.setenv("KVSERVE_COMPILE", "1")
    assert build_engine(tiny_model, EngineConfig(num_blocks=8)).compiled is None  # float32 stays eager unless asked
    assert build_engine(tiny_model, EngineConfig(num_blocks=8, compile=True)).compiled is not None


def test_bfloat16_compiles_when_kvserve_compile_is_on_and_not_by_default(tiny_checkpoint, monkeypatch):
    from libs.engine.model.loader import load_model

    loaded = load_model(str(tiny_checkpoint), dtype="bfloat16", progress=False)
    monkeypatch.delenv("KVSERVE_COMPILE", raising=False)
    assert build_engine(loaded, EngineConfig(num_blocks=8)).compiled is None  # off by default: see the README
    monkeypatch.setenv("KVSERVE_COMPILE", "1")
    assert build_engine(loaded, EngineConfig(num_blocks=8)).compiled is not None


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])  # the forwards that differ from Llama's: biases, q/k norms
def test_compiled_equals_eager_for_each_forward_option(arch):
    from libs.engine.model.loader import load_model
    from tests.conftest import tiny_architecture

    loaded = load_model(str(tiny_architecture(arch)), dtype="float32", quantization="none", progress=False)
    runs = {}
    for compile_ in (True, False):
        engine = build_engine(loaded, EngineConfig(num_blocks=64, enable_prefix_cache=False, compile=compile_))
        engine.warmup()
        assert (engine.compiled is not None) == compile_
        seqs = [Sequence.from_prompt(f"s{i}", prompt(i)) for i in range(3)]
        runs[compile_] = (decode(engine, seqs, 6), [s.output_token_ids for s in seqs])
    assert runs[True][1] == runs[False][1]
    for a, b in zip(runs[True][0], runs[False][0]):
        assert (a - b).abs().max().item() < 1e-4


def test_a_bfloat16_float_model_compiles_with_its_packed_weights(tiny_checkpoint):
    """Its projections are PackedLinear (oneDNN's layout, not a frozen graph constant):
    the graph calls them as an opaque op, and decodes what the eager step does."""
    from libs.engine.model.dense import PackedLinear
    from libs.engine.model.loader import load_model

    loaded = load_model(str(tiny_checkpoint), dtype="bfloat16", quantization="none", progress=False)
    if not isinstance(loaded.model.layers[0].mlp.down_proj, PackedLinear):
        pytest.skip("this torch packs no bfloat16 weight (no oneDNN)")
    runs = {}
    for compile_ in (True, False):
        engine = build_engine(loaded, EngineConfig(num_blocks=64, enable_prefix_cache=False, compile=compile_))
        engine.warmup()
        assert (engine.compiled is not None) == compile_
        seqs = [Sequence.from_prompt(f"s{i}", prompt(i)) for i in range(9)]  # past the fused step's 8 rows
        runs[compile_] = (decode(engine, seqs, 4), [s.output_token_ids for s in seqs])
    assert runs[True][1] == runs[False][1]
    for a, b in zip(runs[True][0], runs[False][0]):
        assert (a - b).abs().max().item() < 0.05  # bfloat16: the graph fuses what eager rounds apart
