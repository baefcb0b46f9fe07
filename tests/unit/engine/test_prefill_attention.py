"""The native prefill-attention kernel computes what gather + SDPA does: chunks with and
without a cached prefix, lengths on and off its tile sizes, scattered blocks, packed
spans; and an engine's prefill through it (whole, chunked, on a cached prefix) gives the
logits of the SDPA path, in bfloat16, to its rounding."""

import pytest
import torch

from libs.engine.model import attention, steps
from libs.engine.model.attention import AttentionBatch, PrefillSpan
from libs.engine.model.engine import EngineConfig
from libs.engine.model.kv_pool import KVLayout, KVPool
from libs.engine.model.loader import build_engine, load_model
from libs.engine.model.sequence import Sequence
from tests.conftest import make_tiny_checkpoint

LAYERS, BLOCK = 3, 16
BF16_TOLERANCE = 1.6e-2  # an ulp or two of bfloat16 at the outputs' size


def needs_kernel() -> None:
    if attention._load_prefill_kernel() is None:
        pytest.skip("no C compiler: the native kernel cannot be built here")
    probe = KVPool(KVLayout(1, BLOCK, 1, 64, torch.bfloat16), 1)
    q = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
    span = PrefillSpan(0, 1, 1, torch.zeros(1, dtype=torch.long))
    if not attention._native_prefill(attention._load_prefill_kernel(), 0, q, probe, span, 1.0, torch.empty_like(q)):
        pytest.skip("the kernel was built without AVX512-BF16 (this CPU lacks it)")


@pytest.fixture(autouse=True)
def every_span_native(monkeypatch):
    """The kernel on every span, however short (the engine keeps SDPA for short ones)."""
    monkeypatch.setattr(attention, "NATIVE_MIN_CONTEXT", 1)


def attend(q, k, v, pool: KVPool, batch: AttentionBatch, path: str, monkeypatch) -> torch.Tensor:
    with monkeypatch.context() as m:
        m.setattr(attention, "prefill_path", path)
        return attention.paged_attention(1, q, k, v, pool, batch, q.shape[-1] ** -0.5)


def packed_batch(spans: list[tuple[int, int]], pool: KVPool, gen: torch.Generator) -> AttentionBatch:
    """Spans of (new tokens, context) over scattered blocks; each span's cached prefix is
    already in the pool (random), its new tokens' slots follow it."""
    free = [int(b) for b in torch.randperm(pool.num_blocks, generator=gen)]
    blocks, offsets, prefill_spans, start = [], [], [], 0
    for n, ctx in spans:
        table = torch.tensor([free.pop() for _ in range(-(-ctx // BLOCK))])
        prefill_spans.append(PrefillSpan(start, n, ctx, table))
        positions = range(ctx - n, ctx)
        blocks += [int(table[p // BLOCK]) for p in positions]
        offsets += [p % BLOCK for p in positions]
        start += n
    return AttentionBatch(torch.tensor(blocks), torch.tensor(offsets), prefill_spans=prefill_spans)


@pytest.mark.parametrize("q_heads, kv_heads, dim", [(9, 3, 64), (8, 2, 128)])
@pytest.mark.parametrize(
    "spans",
    [[(1, 1)], [(5, 5)], [(256, 256)], [(300, 300)], [(37, 100)], [(256, 1000)], [(1, 513)],
     [(40, 40), (17, 200), (256, 300)]],
)  # fmt: skip
def test_native_kernel_matches_sdpa(q_heads, kv_heads, dim, spans, monkeypatch):
    needs_kernel()
    gen = torch.Generator().manual_seed(sum(n + ctx for n, ctx in spans) + dim)
    num_blocks = sum(-(-ctx // BLOCK) for _, ctx in spans) + 4
    pool = KVPool(KVLayout(LAYERS, BLOCK, kv_heads, dim, torch.bfloat16), num_blocks)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=gen) * 2)
    batch = packed_batch(spans, pool, gen)
    total = sum(n for n, _ in spans)
    # q as the model hands it over: a view of the fused q/k rows
    qk = (torch.randn(total, q_heads + kv_heads, dim, generator=gen) * 2).to(torch.bfloat16)
    q = qk[:, :q_heads]
    k = (torch.randn(total, kv_heads, dim, generator=gen) * 2).to(torch.bfloat16)
    v = (torch.randn(total, kv_heads, dim, generator=gen) * 2).to(torch.bfloat16)
    calls = []
    kernel = attention._load_prefill_kernel()
    monkeypatch.setattr(attention, "_load_prefill_kernel", lambda: lambda *a: calls.append(a) or kernel(*a))
    native = attend(q, k, v, pool, batch, "native", monkeypatch).float()
    assert len(calls) == len(spans)  # the kernel ran, once per span
    reference = attend(q, k, v, pool, batch, "sdpa", monkeypatch).float()
    assert len(calls) == len(spans)
    torch.testing.assert_close(native, reference, rtol=BF16_TOLERANCE, atol=BF16_TOLERANCE)


@pytest.mark.parametrize("growth", [0.02, -0.02])
def test_native_kernel_matches_sdpa_when_scores_climb_or_fall_along_the_keys(growth, monkeypatch):
    """The kernel moves a row's running max only when a score passes it by a margin: keys
    whose scores climb along the context move it at almost every step (each move rescales
    what the row has summed so far), falling ones never after the first."""
    needs_kernel()
    gen = torch.Generator().manual_seed(11)
    n, ctx, q_heads, kv_heads, dim = 96, 600, 9, 3, 64
    pool = KVPool(KVLayout(LAYERS, BLOCK, kv_heads, dim, torch.bfloat16), -(-ctx // BLOCK) + 2)
    direction = torch.randn(dim, generator=gen)
    position = torch.arange(ctx, dtype=torch.float32)
    keys = direction * (1 + growth * position)[:, None, None] + torch.randn(ctx, kv_heads, dim, generator=gen) * 0.1
    batch = packed_batch([(n, ctx)], pool, gen)
    table = batch.prefill_spans[0].block_table
    for p in range(ctx):  # the whole context's keys, prefix and new tokens alike
        pool.kv[table[p // BLOCK], 1, 0, p % BLOCK] = keys[p].to(torch.bfloat16)
        pool.kv[table[p // BLOCK], 1, 1, p % BLOCK] = torch.randn(kv_heads, dim, generator=gen).to(torch.bfloat16)
    q = (direction * 0.5 + torch.randn(n, q_heads, dim, generator=gen) * 0.1).to(torch.bfloat16)
    k = pool.kv[table[torch.arange(ctx - n, ctx) // BLOCK], 1, 0, torch.arange(ctx - n, ctx) % BLOCK]
    v = pool.kv[table[torch.arange(ctx - n, ctx) // BLOCK], 1, 1, torch.arange(ctx - n, ctx) % BLOCK]
    native = attend(q, k, v, pool, batch, "native", monkeypatch).float()
    reference = attend(q, k, v, pool, batch, "sdpa", monkeypatch).float()
    torch.testing.assert_close(native, reference, rtol=BF16_TOLERANCE, atol=BF16_TOLERANCE)


def test_kernel_refuses_what_it_cannot_do():
    needs_kernel()
    pool = KVPool(KVLayout(1, BLOCK, 1, 32, torch.bfloat16), 2)  # head size 32: not a multiple of 64
    q = torch.zeros(3, 2, 32, dtype=torch.bfloat16)
    span = PrefillSpan(0, 3, 3, torch.zeros(1, dtype=torch.long))
    assert not attention._native_prefill(attention._load_prefill_kernel(), 0, q, pool, span, 1.0, torch.empty_like(q))
    assert attention._native_prefill_kernel(q.float(), pool) is None  # float32: SDPA


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory):
    """A tiny Llama whose heads are of a real model's size (64), in bfloat16."""
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny64") / "tiny", seed=3, hidden_size=256,
                                  num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=1024)  # fmt: skip
    return load_model(str(folder), dtype="bfloat16", quantization="none", progress=False)


def prefill_logits(loaded, ids: list[int], cached: int, chunk: int, path: str, monkeypatch) -> torch.Tensor:
    """Logits of every token after ``cached`` (those first prefilled on their own and found by
    hash), in steps of ``chunk`` tokens, with the given prefill attention."""
    with monkeypatch.context() as m:
        m.setattr(attention, "prefill_path", path)
        engine = build_engine(loaded, EngineConfig(num_blocks=128, max_chunk_tokens=chunk))
        if cached:
            steps.prefill(engine, [Sequence.from_prompt("head", ids[:cached])])
        seq = Sequence.from_prompt("seq", ids)
        assert engine.cache.match_prefix(seq) == cached
        return steps.prefill_all_logits(engine, [seq])[0]


@pytest.mark.parametrize("cached, chunk", [(0, 1024), (0, 64), (160, 1024), (160, 96)])
def test_engine_prefill_matches_sdpa_path(tiny_bf16, cached, chunk, monkeypatch):
    needs_kernel()
    ids = torch.randint(0, 256, (700,), generator=torch.Generator().manual_seed(cached + chunk)).tolist()
    calls = []
    kernel = attention._load_prefill_kernel()
    monkeypatch.setattr(attention, "_load_prefill_kernel", lambda: lambda *a: calls.append(a) or kernel(*a))
    native = prefill_logits(tiny_bf16, ids, cached, chunk, "native", monkeypatch)
    num_chunks = -(-cached // chunk) + -(-(len(ids) - cached) // chunk)  # the cached head's, then the rest's
    assert len(calls) == tiny_bf16.model.config.num_layers * num_chunks  # every layer of every step used the kernel
    reference = prefill_logits(tiny_bf16, ids, cached, chunk, "sdpa", monkeypatch)
    assert native.shape == (len(ids) - cached, tiny_bf16.model.config.vocab_size)
    # bfloat16 activations: the two paths round some attention outputs differently by an
    # ulp, which three layers carry on; logits of about one unit agree to an ulp or two
    assert (native - reference).abs().max().item() < 0.02


def test_short_spans_keep_sdpa(monkeypatch):
    """Under the engine's threshold a span's attention is SDPA's, at it and above the kernel's."""
    needs_kernel()
    monkeypatch.setattr(attention, "NATIVE_MIN_CONTEXT", 128)
    gen = torch.Generator().manual_seed(7)
    pool = KVPool(KVLayout(LAYERS, BLOCK, 3, 64, torch.bfloat16), 48)
    calls = []
    kernel = attention._load_prefill_kernel()
    monkeypatch.setattr(attention, "_load_prefill_kernel", lambda: lambda *a: calls.append(a[5]) or kernel(*a))
    batch = packed_batch([(40, 40), (17, 127), (16, 128), (100, 300)], pool, gen)
    q = torch.randn(173, 9, 64, generator=gen).to(torch.bfloat16)
    k = torch.randn(173, 3, 64, generator=gen).to(torch.bfloat16)
    attend(q, k, k.clone(), pool, batch, "native", monkeypatch)
    assert calls == [128, 300]  # the context lengths the kernel was called for
