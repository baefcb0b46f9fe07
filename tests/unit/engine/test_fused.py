"""The fused forward (fused.py) computes what the modules of llama.py do, bit for bit:
the decode step gives the same logits at every step, so the same greedy tokens; the
prefill step the same logits for every token and the same K/V in the pool, whole,
chunked, packed and after a cached prefix; for int4, int8 and float projections, with
and without biases, on the default model and a tiny one of each architecture."""

import pytest
import torch

from libs.engine.model import attention, steps
from libs.engine.model.engine import EngineConfig
from libs.engine.model.fused import FusedForward, _ops
from libs.engine.model.loader import build_engine, load_model, resolve_dtype
from libs.engine.model.sequence import Sequence
from tests.conftest import TINY_ARCHITECTURES, make_tiny_checkpoint, tiny_architecture
from tests.unit.engine.test_compiled import decode

STEPS = 12


@pytest.fixture(autouse=True)
def kernels():
    if _ops() is None:
        pytest.skip("no C compiler: the native kernels cannot be built here")


@pytest.fixture
def one_thread():
    """torch on one thread, as `kvserve up` runs each worker on a 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def default_bf16():
    return load_model(None, dtype="bfloat16", progress=False)  # the GGUF's int4, as served


def prompts(batch: int, vocab: int) -> list[list[int]]:
    return [[(11 * i + 5 * j) % (vocab - 10) + 3 for j in range(7 + 29 * i)] for i in range(batch)]  # 7..210 tokens


def greedy(loaded, fuse: bool, batch: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    engine = build_engine(loaded, EngineConfig(num_blocks=256, enable_prefix_cache=False, fuse_decode=fuse,
                                               fuse_prefill=fuse))  # fmt: skip
    assert (engine.fused is not None) == fuse
    seqs = [Sequence.from_prompt(f"s{i}", p) for i, p in enumerate(prompts(batch, loaded.model.config.vocab_size))]
    steps = decode(engine, seqs, STEPS)
    return [s.output_token_ids for s in seqs], steps


def assert_same(loaded, batch: int) -> None:
    fused_tokens, fused_logits = greedy(loaded, True, batch)
    tokens, logits = greedy(loaded, False, batch)
    assert fused_tokens == tokens
    for a, b in zip(fused_logits, logits):
        assert torch.equal(a, b)


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_fused_step_equals_the_modules_on_the_default_model(default_bf16, batch):
    if batch > 1 and resolve_dtype("auto", torch.device("cpu")) != torch.bfloat16:
        # 30 s to minutes of bfloat16 without a fast path, for a step kvserve never fuses here (it
        # serves float32); batches of 3 and 8 rows are checked on tiny models below on every CPU
        pytest.skip("bfloat16 has no fast path on this CPU: kvserve serves float32 here, where nothing is fused")
    assert_same(default_bf16, batch)


@pytest.mark.parametrize("quantization, bias, batch", [("int4", False, 3), ("int4", False, 8), ("int8", False, 3),
                                                       ("none", True, 3)])  # fmt: skip
def test_fused_step_equals_the_modules_for_every_projection(tmp_path, quantization, bias, batch):
    folder = make_tiny_checkpoint(tmp_path / "tiny", seed=3, attention_bias=bias)
    loaded = load_model(str(folder), dtype="bfloat16", quantization=quantization, progress=False)
    if bias:
        with torch.no_grad():  # a saved random model's biases are zeros: make them count
            for layer in loaded.model.layers:
                layer.self_attn.qkv_proj.bias.normal_(0, 0.5)
    assert_same(loaded, batch)


def test_fused_step_equals_the_modules_on_one_thread(tmp_path, one_thread):
    """One sequence's int8 projections on one thread run the native int8 kernel, in both."""
    folder = make_tiny_checkpoint(tmp_path / "tiny", seed=4)
    assert_same(load_model(str(folder), dtype="bfloat16", quantization="int8", progress=False), 1)


@pytest.mark.parametrize("quantization", ["none", "int4"])
@pytest.mark.parametrize("arch", sorted(TINY_ARCHITECTURES))
def test_fused_step_equals_the_modules_for_every_architecture(arch, quantization):
    loaded = load_model(str(tiny_architecture(arch)), dtype="bfloat16", quantization=quantization, progress=False)
    assert_same(loaded, 3)


def test_larger_batches_and_float32_use_the_modules(default_bf16, tiny_checkpoint):
    engine = build_engine(default_bf16, EngineConfig(num_blocks=64))
    assert engine.fused is not None and engine.fused.max_rows == 8
    with pytest.raises(ValueError, match="unpadded rows"):
        ids = torch.zeros(9, dtype=torch.long)
        engine.fused.decode(ids, ids, None)
    tiny32 = load_model(str(tiny_checkpoint), dtype="float32", progress=False)
    assert FusedForward.build(tiny32.model, build_engine(tiny32, EngineConfig(num_blocks=64)).pool) is None


def test_a_shape_the_native_attention_refuses_runs_the_modules(tmp_path):
    """17 query heads to one KV head: more than the decode kernel's 16 (the modules then use SDPA)."""
    folder = make_tiny_checkpoint(tmp_path / "wide", num_attention_heads=17, num_key_value_heads=1, hidden_size=68)
    loaded = load_model(str(folder), dtype="bfloat16", quantization="none", progress=False)
    engine = build_engine(loaded, EngineConfig(num_blocks=64))
    assert engine.fused is None
    decode(engine, [Sequence.from_prompt("s", [1, 2, 3])], 2)


def prefill(loaded, fuse: bool, chunk: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Every computed token's logits, and the pool after them, of three sequences packed
    into steps of at most ``chunk`` tokens: one too short for the native prefill attention
    (SDPA), one long, one extending a head prefilled before and found by hash."""
    engine = build_engine(loaded, EngineConfig(num_blocks=128, max_chunk_tokens=chunk, fuse_decode=False,
                                               fuse_prefill=fuse))  # fmt: skip
    assert (engine.fused is not None) == fuse
    vocab = loaded.model.config.vocab_size
    ids = torch.randint(3, vocab, (240,), generator=torch.Generator().manual_seed(chunk)).tolist()  # tiny: 256 fit
    steps.prefill(engine, [Sequence.from_prompt("head", ids[:96])])
    seqs = [Sequence.from_prompt("short", ids[100:140]), Sequence.from_prompt("long", ids[20:220]),
            Sequence.from_prompt("cached", ids)]  # fmt: skip
    assert engine.cache.match_prefix(seqs[2]) == 96
    return steps.prefill_all_logits(engine, seqs), engine.pool.kv


def assert_same_prefill(loaded, chunk: int) -> None:
    fused_logits, fused_pool = prefill(loaded, True, chunk)
    logits, pool = prefill(loaded, False, chunk)
    for a, b in zip(fused_logits, logits, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(fused_pool, pool)


@pytest.mark.parametrize("chunk", [512, 96])
def test_fused_prefill_equals_the_modules_on_the_default_model(default_bf16, chunk, monkeypatch):
    if resolve_dtype("auto", torch.device("cpu")) != torch.bfloat16:
        pytest.skip("bfloat16 has no fast path on this CPU: kvserve serves float32 here, where nothing is fused")
    kernel, spans = attention._load_prefill_kernel(), []
    if kernel is not None:  # which spans the native attention took, by context length
        monkeypatch.setattr(attention, "_load_prefill_kernel", lambda: lambda *a: spans.append(a[5]) or kernel(*a))
    assert_same_prefill(default_bf16, chunk)
    if kernel is not None:
        assert min(spans) >= attention.NATIVE_MIN_CONTEXT and max(spans) == 240  # the short one: SDPA


@pytest.mark.parametrize("quantization, bias", [("int4", False), ("int8", False), ("none", True)])
def test_fused_prefill_equals_the_modules_for_every_projection(tmp_path, quantization, bias):
    folder = make_tiny_checkpoint(tmp_path / "tiny", seed=3, attention_bias=bias)
    loaded = load_model(str(folder), dtype="bfloat16", quantization=quantization, progress=False)
    if bias:
        with torch.no_grad():
            for layer in loaded.model.layers:
                layer.self_attn.qkv_proj.bias.normal_(0, 0.5)
    assert_same_prefill(loaded, 96)


@pytest.mark.parametrize("arch", sorted(TINY_ARCHITECTURES))
def test_fused_prefill_equals_the_modules_for_every_architecture(arch):
    loaded = load_model(str(tiny_architecture(arch)), dtype="bfloat16", quantization="int4", progress=False)
    assert_same_prefill(loaded, 96)
