"""Attention over the paged KV pool, for a packed batch of new tokens.

The model hands each layer's new q/k/v here; this module writes k/v into the
pool at the tokens' slots and attends over each sequence's blocks. Prefill
batches are packed (``[T, ...]``, sequences back to back, each with its own
cached context); decode batches are one token per sequence, padded to the
longest block table and masked.

Both have a native kernel that reads K/V in place from the pool (kernels/), and a
PyTorch path (gather + SDPA) used where the kernel cannot run and as its reference.
"""

import ctypes
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from libs.engine.model import native
from libs.engine.model.kv_pool import KVPool

PREFILL_PATHS = ("native", "sdpa")
# Which prefill attention runs where both can: the native blocked kernel
# (kernels/prefill_attention.c: bfloat16 on a CPU with AVX512-BF16; elsewhere it declines
# and SDPA runs) or gather + SDPA. Native by default: measured 1.17-1.70x SDPA's prefill
# tokens/s from 512 to 8,192 tokens, and as close to float32's logits over 36,864
# positions of English prose (mean KL 2.35e-3 against SDPA's 2.36e-3; top token
# different from float32's at 4.59% against 4.48% of positions: bench/results/engine.md).
# KVSERVE_NATIVE_KERNELS=0 turns it off with the other kernels; bench/prefill_attention.py
# flips this to measure both in one process.
prefill_path = "native"
# Spans attending to fewer tokens than this keep SDPA: there the kernel measured no
# faster (0.94-1.04x at 64 tokens, 1.02x at 32; 1.05-1.12x at 128), and a short chat
# prompt's first token is then the one the SDPA path always gave (the default model's
# answer to "What is the capital of France?" is a near-tie that the two paths' roundings
# break differently).
NATIVE_MIN_CONTEXT = 128


@dataclass
class PrefillSpan:
    """One sequence's share of a packed prefill batch."""

    query_start: int  # first of its rows in the packed batch
    query_len: int  # new tokens computed now
    context_len: int  # tokens attended to: cached context + the new ones
    block_table: torch.Tensor  # [num_blocks] long, covering context_len


@dataclass
class AttentionBatch:
    slot_blocks: torch.Tensor  # [T] long: the block each new token's K/V goes to
    slot_offsets: torch.Tensor  # [T] long: its position inside that block
    prefill_spans: list[PrefillSpan] | None = None
    decode_block_tables: torch.Tensor | None = None  # [B, max_blocks] long, padded
    decode_lens: torch.Tensor | None = None  # [B] long: tokens each sequence attends to
    # [T] long: the row whose K/V each slot receives. A padded decode batch repeats a
    # real row's slot and writes that row's own K/V there again, so padding never
    # changes a byte of the pool. None: row i writes its own.
    slot_rows: torch.Tensor | None = None

    @property
    def is_decode(self) -> bool:
        return self.decode_block_tables is not None


def paged_attention(
    layer: int,
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    pool: KVPool,
    batch: AttentionBatch,
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    if batch.is_decode:
        if torch.compiler.is_compiling():
            return torch.ops.kvserve.paged_decode_attention(
                q, k, v, pool.kv, batch.slot_blocks, batch.slot_offsets, batch.slot_rows,
                batch.decode_block_tables, batch.decode_lens, layer, scale,
            )  # fmt: skip
        return _decode(layer, q, k, v, pool, batch, scale)
    pool.write(layer, batch.slot_blocks, batch.slot_offsets, k, v)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, Hq, D], contiguous
    for span, done in zip(batch.prefill_spans, native_prefill_spans(layer, q, pool, batch, scale, out)):
        if not done:
            rows = slice(span.query_start, span.query_start + span.query_len)
            out[rows] = sdpa_prefill(layer, q[rows], k[rows], v[rows], pool, span, scale)
    return out


def native_prefill_spans(
    layer: int, q: torch.Tensor, pool: KVPool, batch: AttentionBatch, scale: float, out: torch.Tensor
) -> list[bool]:
    """Each prefill span's attention by the native kernel, into its rows of ``out`` ([T, Hq,
    D], contiguous), where the kernel runs (its K/V already in the pool): per span, whether
    it ran. The others are the caller's, by ``sdpa_prefill``."""
    kernel = _native_prefill_kernel(q, pool)
    done = []
    for span in batch.prefill_spans:
        rows = slice(span.query_start, span.query_start + span.query_len)
        done.append(
            kernel is not None
            and span.context_len >= NATIVE_MIN_CONTEXT
            and _native_prefill(kernel, layer, q[rows], pool, span, scale, out[rows])
        )
    return done


def _decode(
    layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: KVPool, batch: AttentionBatch, scale: float
) -> torch.Tensor:
    rows = batch.slot_rows
    if rows is None:
        pool.write(layer, batch.slot_blocks, batch.slot_offsets, k, v)
    else:
        pool.write(layer, batch.slot_blocks, batch.slot_offsets, k[rows], v[rows])
    return _decode_attention(layer, q.contiguous(), pool, batch, scale)  # q: a view of q and k rotated together


# A compiled decode step calls the KV write and the attention as one op that the
# compiler sees as opaque and pure. The pool is the engine's, written in place; were
# the write visible, functionalization would copy the whole pool on every step. Hiding
# it loses no ordering: nothing else in the graph reads the pool, and each layer's op
# depends on the one before through its hidden state.
@torch.library.custom_op("kvserve::paged_decode_attention", mutates_args=())
def _decode_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
    slot_rows: torch.Tensor | None,
    block_tables: torch.Tensor,
    lens: torch.Tensor,
    layer: int,
    scale: float,
) -> torch.Tensor:
    batch = AttentionBatch(slot_blocks, slot_offsets, decode_block_tables=block_tables, decode_lens=lens,
                           slot_rows=slot_rows)  # fmt: skip
    return _decode(layer, q, k, v, KVPool.over(kv), batch, scale)


@_decode_op.register_fake
def _(q: torch.Tensor, *args) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def sdpa_prefill(
    layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: KVPool, span: PrefillSpan, scale: float
) -> torch.Tensor:
    n, ctx = span.query_len, span.context_len
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
    if ctx == n:  # nothing cached: attend to this chunk alone, plain causal
        kh = k.transpose(0, 1).unsqueeze(0)  # [1, Hkv, n, D]
        vh = v.transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:  # attend to the cached context in the pool (which now holds this chunk too)
        kh = _gather(pool, layer, 0, span.block_table, ctx)  # [1, Hkv, ctx, D]
        vh = _gather(pool, layer, 1, span.block_table, ctx)
        # row i is position ctx - n + i and sees every key up to it
        mask = torch.ones(n, ctx, dtype=torch.bool, device=q.device).tril(diagonal=ctx - n)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)  # [n, Hq, D]


def _native_prefill(
    kernel, layer: int, q: torch.Tensor, pool: KVPool, span: PrefillSpan, scale: float, out: torch.Tensor
) -> bool:
    """One span's attention by the native kernel into ``out`` ([n, Hq, D], contiguous);
    False where it cannot run (the caller then uses SDPA)."""
    layout = pool.layout
    table = span.block_table
    status = kernel(
        q.data_ptr(), q.stride(0), pool.kv.data_ptr(), table.data_ptr(), span.query_len, span.context_len,
        out.data_ptr(), q.shape[1], layout.num_kv_heads, layout.head_dim, layout.block_size, layout.num_layers,
        layer, scale,
    )  # fmt: skip
    return status == 0


def _native_prefill_kernel(q: torch.Tensor, pool: KVPool):
    """The native prefill kernel where it applies: bfloat16 on the CPU, each row's heads
    contiguous (q may be a view of the fused q/k rows)."""
    if (
        prefill_path != "native"
        or q.device.type != "cpu"
        or q.dtype != torch.bfloat16
        or pool.kv.dtype != torch.bfloat16
        or q.stride(2) != 1
        or q.stride(1) != q.shape[2]
    ):
        return None
    return _load_prefill_kernel()


@functools.cache
def _load_prefill_kernel():
    lib = native.load("prefill_attention")
    if lib is None:
        return None
    return prefill_kernel_signature(lib.paged_prefill_attention)


def prefill_kernel_signature(fn):
    """``paged_prefill_attention``'s C signature on a ctypes function (the bench that compares
    revisions of the kernel loads them with it too)."""
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_void_p] + [ctypes.c_int] * 6 + [ctypes.c_float]  # fmt: skip
    return fn


def _gather(pool: KVPool, layer: int, plane: int, block_table: torch.Tensor, length: int) -> torch.Tensor:
    blocks = pool.gather(layer, plane, block_table)  # [nb, bs, H, D]
    return blocks.flatten(0, 1)[:length].transpose(0, 1).unsqueeze(0)  # [1, H, length, D]


def _decode_attention(layer: int, q: torch.Tensor, pool: KVPool, batch: AttentionBatch, scale: float) -> torch.Tensor:
    kernel = _native_decode_kernel(q, pool)
    if kernel is not None:  # reads K/V in place from the blocks: no gather, each row once
        out = torch.empty_like(q)
        layout = pool.layout
        status = kernel(
            q.data_ptr(), pool.kv.data_ptr(), batch.decode_block_tables.data_ptr(), batch.decode_lens.data_ptr(),
            out.data_ptr(), q.shape[0], q.shape[1], layout.num_kv_heads, layout.head_dim, layout.block_size,
            layout.num_layers, layer, batch.decode_block_tables.shape[1], scale, int(q.dtype == torch.bfloat16),
        )  # fmt: skip
        if status == 0:
            return out
    tables = batch.decode_block_tables
    keys = pool.gather(layer, 0, tables).flatten(1, 2).transpose(1, 2)  # [B, Hkv, S, D]
    values = pool.gather(layer, 1, tables).flatten(1, 2).transpose(1, 2)
    bsz, num_heads, dim = q.shape
    mask = torch.arange(keys.shape[2], device=q.device) < batch.decode_lens[:, None]  # [B, S]
    # One new token per sequence, so the query heads sharing a KV head can stand in
    # for a query length: [B, Hkv, group, D] attends without repeating K/V (~15% faster).
    qh = q.view(bsz, keys.shape[1], num_heads // keys.shape[1], dim)
    out = F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask[:, None, None, :], scale=scale)
    return out.reshape(bsz, num_heads, dim)


def _native_decode_kernel(q: torch.Tensor, pool: KVPool):
    if q.device.type != "cpu" or q.dtype not in (torch.float32, torch.bfloat16) or not q.is_contiguous():
        return None
    return _load_kernel()


@functools.cache
def _load_kernel():
    lib = native.load("paged_attention")
    if lib is None:
        return None
    fn = lib.paged_decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 8 + [ctypes.c_float, ctypes.c_int]
    return fn
