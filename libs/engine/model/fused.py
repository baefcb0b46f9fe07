"""The forward pass with each layer's small steps fused: a decode step of a few
sequences, and a prefill step.

A decode step over one to ``KERNEL_MAX_ROWS`` sequences reads every weight once and
does little arithmetic; run through the modules of llama.py it launches ~25 small
PyTorch ops per layer (an RMSNorm is eight), whose Python and dispatch cost more than
the weight-only matmuls themselves. Here a layer is eight calls: the four projections
(torch's int4/int8 kernels, straight to the op), and three native kernels from
``kernels/decode_ops.c`` — the residual add with the next RMSNorm, RoPE with the KV
write, SiLU times up — plus the paged attention kernel (and, for a model with
per-head q/k norms, the modules' own norm between the qkv projection and RoPE).

A prefill step of hundreds of rows spends its time in the projections, but the same
small steps, each a pass or several over the step's activations, took ~13% of it at
2,048 tokens (bench/results/engine.md). ``prefill`` runs the same native kernels over
every row of the step (threaded), the modules' projections and the prefill attention.

Every value is rounded to bfloat16 where the modules round it, so the tokens are
the modules' tokens. Only for bfloat16 on the CPU with the native kernels loaded
(``FusedForward.build`` says None otherwise, and the caller runs the modules); decode
batches past ``max_rows`` run the modules too, their time in the matmuls. The model,
the pool and the batch stay as they are: this module adds no state beyond a few
pointers and a scratch buffer per decode batch size.
"""

import ctypes
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from libs.engine.model import native
from libs.engine.model.attention import AttentionBatch, _load_kernel, native_prefill_spans, sdpa_prefill
from libs.engine.model.kv_pool import KVPool
from libs.engine.model.llama import LlamaModel, RMSNorm
from libs.engine.model.quant import KERNEL_MAX_ROWS

_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
MAX_GROUP, MAX_HEAD_DIM = 16, 256  # kernels/paged_attention.c's MAX_GROUP and MAX_DIM: it refuses more


@functools.cache
def _ops():
    lib = native.load("decode_ops")
    if lib is None:
        return None
    lib.add_rms_norm.argtypes = [_P, _P, _P, _P, _I, _I, _F, _I]
    lib.add_rms_norm.restype = ctypes.c_int
    lib.rope_kv_write.argtypes = [_P] * 8 + [_I] * 7
    lib.rope_kv_write.restype = None
    lib.silu_mul.argtypes = [_P, _P, _I, _I]
    lib.silu_mul.restype = None
    return lib


@functools.cache
def torch_lanes(dim: int) -> int:
    """The float32 vector width PyTorch's sum kernel runs with here (its summation order
    depends on it): the width with which add_rms_norm reproduces llama.RMSNorm on random
    rows. 8 on x86 with AVX2 or AVX-512 today (torch registers no AVX-512 sum); should
    none match, 8, and the two paths differ by a float32 rounding now and then."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(64, dim, generator=gen) * 3).to(torch.bfloat16)
    norm = RMSNorm(dim, 1e-5).to(torch.bfloat16)
    norm.weight.data.normal_(generator=gen)
    with torch.no_grad():
        want = norm(x)
    for lanes in (8, 16, 4):
        got, scratch = torch.empty_like(x), x.clone()
        _ops().add_rms_norm(scratch.data_ptr(), None, norm.weight.data_ptr(), got.data_ptr(), 64, dim, 1e-5, lanes)
        if torch.equal(got, want):
            return lanes
    return 8


class FusedForward:
    """``decode(input_ids, positions, batch)`` for batches of at most ``KERNEL_MAX_ROWS`` rows
    without padding, ``prefill(...)`` for any packed prefill batch: hidden states after the
    final norm, as ``LlamaModel.forward`` gives them."""

    max_rows = KERNEL_MAX_ROWS

    @classmethod
    def build(cls, model: LlamaModel, pool: KVPool) -> "FusedForward | None":
        if pool.kv.device.type != "cpu" or pool.kv.dtype != torch.bfloat16:
            return None
        if model.embed_tokens.weight.dtype != torch.bfloat16 or model.embed_tokens.weight.device.type != "cpu":
            return None
        if _ops() is None or _load_kernel() is None:
            return None
        c = model.config
        if c.hidden_size > 8192 or c.intermediate_size > 16384:  # the kernels' row buffers
            return None
        if c.num_heads // c.num_kv_heads > MAX_GROUP or c.head_dim > MAX_HEAD_DIM:  # the modules fall back to SDPA
            return None
        projections = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            modules = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            four = [m.row_op(torch.bfloat16) if hasattr(m, "row_op") else None for m in modules]
            if any(p is None for p in four):
                return None
            projections.append(four)
        return cls(model, pool, projections)

    def __init__(self, model: LlamaModel, pool: KVPool, projections: list[list]) -> None:
        c = model.config
        self.model, self.pool, self.projections = model, pool, projections
        self.modules = [(layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
                        for layer in model.layers]  # fmt: skip
        self.ops, self.attention = _ops(), _load_kernel()
        self.hidden, self.eps = c.hidden_size, c.rms_norm_eps
        self.q_heads, self.kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.intermediate = c.intermediate_size
        self.qk_norm = c.qk_norm
        self.scale = c.head_dim**-0.5
        self.lanes = torch_lanes(c.hidden_size)
        layout = pool.layout
        self.block_size, self.num_layers = layout.block_size, layout.num_layers
        # each layer's input norm weight, then the next's (the last layer's "next" is the final norm)
        norms = [layer.input_layernorm.weight for layer in model.layers] + [model.norm.weight]
        self.post_norms = [layer.post_attention_layernorm.weight.data_ptr() for layer in model.layers]
        self.next_norms = [w.data_ptr() for w in norms[1:]]
        self.first_norm = norms[0].data_ptr()
        self.cos = model.rope.cos.to(torch.bfloat16).contiguous()
        self.sin = model.rope.sin.to(torch.bfloat16).contiguous()
        self._scratch: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def scratch(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated q, attention output and SiLU product for ``rows`` rows, reused every step."""
        bufs = self._scratch.get(rows)
        if bufs is None:
            q = torch.empty(rows, self.q_heads, self.head_dim, dtype=torch.bfloat16)
            attended = torch.empty(rows, self.q_heads * self.head_dim, dtype=torch.bfloat16)
            product = torch.empty(rows, self.intermediate, dtype=torch.bfloat16)
            bufs = self._scratch[rows] = (q, attended, product)
        return bufs

    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """A decode step of 1 to ``max_rows`` unpadded rows: hidden [B, hidden] after the final norm."""
        rows = input_ids.shape[0]
        if rows > self.max_rows or batch.slot_rows is not None:
            raise ValueError(f"the fused decode runs 1-{self.max_rows} unpadded rows, got {rows}")
        q, attended, product = self.scratch(rows)
        tables, lens = batch.decode_block_tables, batch.decode_lens
        tables_ptr, lens_ptr, max_blocks = tables.data_ptr(), lens.data_ptr(), tables.shape[1]
        q_ptr, pool_ptr, attended_ptr = q.data_ptr(), self.pool.kv.data_ptr(), attended.data_ptr()
        qh, kvh, dim, bs, nl = self.q_heads, self.kv_heads, self.head_dim, self.block_size, self.num_layers

        def attend(layer: int, qkv: torch.Tensor) -> None:
            status = self.attention(q_ptr, pool_ptr, tables_ptr, lens_ptr, attended_ptr, rows, qh, kvh, dim, bs, nl,
                                    layer, max_blocks, self.scale, 1)  # fmt: skip
            if status != 0:
                raise RuntimeError(f"the native decode attention failed ({status})")

        return self._layers(input_ids, positions, batch, self.projections, q, attended, product, attend, None)

    def prefill(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                layer_done: Callable[[int], None] | None = None) -> torch.Tensor:  # fmt: skip
        """A packed prefill step (``batch.prefill_spans``): hidden [T, hidden] after the final
        norm, as the modules give it. The projections are the modules' own (dense weights at
        these sizes); each span attends as ``attention.paged_attention`` would have it, its
        K/V already in the pool."""
        rows = input_ids.shape[0]
        q = torch.empty(rows, self.q_heads, self.head_dim, dtype=torch.bfloat16)
        attended = torch.empty(rows, self.q_heads * self.head_dim, dtype=torch.bfloat16)
        product = torch.empty(rows, self.intermediate, dtype=torch.bfloat16)
        out = attended.view(rows, self.q_heads, self.head_dim)
        v_start = (self.q_heads + self.kv_heads) * self.head_dim

        def attend(layer: int, qkv: torch.Tensor) -> None:
            k = v = None  # the SDPA path's k and v, for a span too short for the kernel
            done = native_prefill_spans(layer, q, self.pool, batch, self.scale, out)
            for span, ok in zip(batch.prefill_spans, done):
                if ok:
                    continue
                if k is None:
                    k = self.pool.kv[batch.slot_blocks, layer, 0, batch.slot_offsets]  # [T, Hkv, D], rotated
                    v = qkv[:, v_start:].view(rows, self.kv_heads, self.head_dim)
                r = slice(span.query_start, span.query_start + span.query_len)
                out[r] = sdpa_prefill(layer, q[r], k[r], v[r], self.pool, span, self.scale)

        return self._layers(input_ids, positions, batch, self.modules, q, attended, product, attend, layer_done)

    def _layers(self, input_ids, positions, batch, projections, q, attended, product, attend, layer_done):
        """Every layer over ``input_ids``' rows: ``projections`` per layer (qkv, o, gate_up,
        down), ``attend(layer, qkv)`` filling ``attended`` from ``q`` and the pool."""
        ops = self.ops
        rows = input_ids.shape[0]
        q_ptr, product_ptr = q.data_ptr(), product.data_ptr()
        x = F.embedding(input_ids, self.model.embed_tokens.weight)  # the residual stream, updated in place
        h = torch.empty_like(x)
        x_ptr, h_ptr = x.data_ptr(), h.data_ptr()
        pool = self.pool.kv.data_ptr()
        positions_ptr, blocks_ptr, offsets_ptr = positions.data_ptr(), batch.slot_blocks.data_ptr(), \
            batch.slot_offsets.data_ptr()  # fmt: skip
        cos, sin = self.cos.data_ptr(), self.sin.data_ptr()
        hidden, eps, lanes = self.hidden, self.eps, self.lanes
        qh, kvh, dim = self.q_heads, self.kv_heads, self.head_dim
        bs, nl = self.block_size, self.num_layers
        qk_size = (qh + kvh) * dim
        ops.add_rms_norm(x_ptr, None, self.first_norm, h_ptr, rows, hidden, eps, lanes)
        for layer, (qkv_proj, o_proj, gate_up_proj, down_proj) in enumerate(projections):
            qkv = qkv_proj(h)
            if self.qk_norm:  # Qwen3's per-head norms, the modules' own code on the same rows
                attn = self.model.layers[layer].self_attn
                qk = qkv[:, : qk_size].view(rows, qh + kvh, dim)
                qk.copy_(attn.norm_qk(qk))
            ops.rope_kv_write(qkv.data_ptr(), cos, sin, positions_ptr, q_ptr, pool, blocks_ptr, offsets_ptr,
                              rows, qh, kvh, dim, bs, nl, layer)  # fmt: skip
            attend(layer, qkv)
            o = o_proj(attended)
            ops.add_rms_norm(x_ptr, o.data_ptr(), self.post_norms[layer], h_ptr, rows, hidden, eps, lanes)
            gate_up = gate_up_proj(h)
            ops.silu_mul(gate_up.data_ptr(), product_ptr, rows, self.intermediate)
            d = down_proj(product)
            ops.add_rms_norm(x_ptr, d.data_ptr(), self.next_norms[layer], h_ptr, rows, hidden, eps, lanes)
            if layer_done is not None:
                layer_done(layer)
        return h
