"""A Llama-family transformer in plain PyTorch, reading and writing a paged KV pool.

RMSNorm -> rotary embeddings -> grouped-query attention -> SwiGLU MLP ->
decoder layer -> model. Llama, Mistral, Qwen2, Qwen3 and Phi-3 are this one
model with the options of config.py: q/k/v and output biases, a per-head q/k
RMSNorm, the rotary scaling. Inputs are packed: ``input_ids`` and ``positions`` are
``[T]`` (every new token of every sequence in the batch, back to back), and
``AttentionBatch`` says which rows belong to which sequence and where their
K/V live. q/k/v and gate/up are fused into one matmul each; ``load_weights``
takes Hugging Face tensor names and fills the fused weights, and with a
quantization swaps each ``Linear`` for its weight-only quantized twin (quant.py).
"""

import math
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from libs.common import heap
from libs.engine.model.attention import AttentionBatch, paged_attention
from libs.engine.model.config import ModelConfig
from libs.engine.model.dense import FloatLinear, PackedLinear, float_row_op, packs
from libs.engine.model.kv_pool import KVPool
from libs.engine.model.quant import (
    NONE,
    Int8Linear,
    QuantizedWeight,
    concat,
    convert,
    kernels_apply,
    quantize_int8,
    quantized_linear,
)

LayerCallback = Callable[[int], None]  # called with each layer index once its K/V is written


class Linear(nn.Module):
    """``y = x W^T + b`` with W stored transposed, ``[in, out]``: CPU BLAS runs the
    plain product up to twice as fast as the transposed one at decode batch sizes
    (and no slower at prefill sizes). Loading transposes HF's ``[out, in]`` once."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return x @ self.weight_t
        return torch.addmm(self.bias, x, self.weight_t)

    def row_op(self, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """``forward`` for 2-D ``dtype`` rows without its dispatch (as quant's row_op); None
        when the weight is in another dtype."""
        return float_row_op(self.weight_t, self.bias, dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies with the checkpoint's theta and scaling (none, linear, llama3)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_context = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_context / low, old_context / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    if kind == "freq_factors":  # a GGUF's rope_freqs: what llama.cpp divides each frequency by
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    raise ValueError(f"unsupported rope scaling {kind!r}")


class RotaryEmbedding:
    """cos/sin tables for every position up to the context window: ``[max_pos, D]``."""

    def __init__(self, config: ModelConfig, device: torch.device | str) -> None:
        positions = torch.arange(config.max_position_embeddings, dtype=torch.int64).float()
        freqs = torch.outer(positions, rope_inv_freq(config))  # [max_pos, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device)
        self.sin = emb.sin().to(device)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for these positions, [T, 1, D], looked up once per forward."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin) for the batch's positions


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, config.qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, config.o_bias)
        # Qwen3: each head of q and of k RMS-normalised over its D values before RoPE
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.scale = self.head_dim**-0.5

    def forward(self, x: torch.Tensor, rope: Rope, pool: KVPool, batch: AttentionBatch) -> torch.Tensor:
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = self.norm_qk(qk.view(-1, self.num_heads + self.num_kv_heads, self.head_dim))  # [T, Hq + Hkv, D]
        # q and k rotated together, half the ops of rotating each
        qk = apply_rope(qk, *rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # [T, Hq, D], [T, Hkv, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        out = paged_attention(self.layer, q, k, v, pool, batch, self.scale)  # [T, Hq, D]
        return self.o_proj(out.flatten(1))

    def norm_qk(self, qk: torch.Tensor) -> torch.Tensor:
        """q's and k's heads, [T, Hq + Hkv, D], through their per-head norms (when the
        model has them); the fused decode step calls this too, for the same rounding."""
        if self.q_norm is None:
            return qk
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, rope: Rope, pool: KVPool, batch: AttentionBatch) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, pool, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # built without a random init (the checkpoint fills them): on the meta device an
        # init still costs ~1.3 s of torch's lazy set-up at every worker start
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))  # fmt: skip
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # kept [vocab, hidden] (not transposed) so it can share the embedding's storage
        self.lm_head = nn.utils.skip_init(nn.Linear, config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope: RotaryEmbedding | None = None  # built by `materialize` on the final device
        self.quantization = NONE  # what `load_weights` made of the projections: none, int8 or int4-gN

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        pool: KVPool,
        batch: AttentionBatch,
        layer_done: LayerCallback | None = None,
    ) -> torch.Tensor:  # [T, hidden], after the final norm
        x = self.embed_tokens(input_ids)
        rope = self.rope.tables(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, rope, pool, batch)
            if layer_done is not None:
                layer_done(layer.self_attn.layer)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's logits, float32 where the head can give them unrounded (an int8 head:
        ``Int8Linear.logits``), else in the head's dtype."""
        logits = getattr(self.lm_head, "logits", None)
        return logits(hidden) if logits is not None else self.lm_head(hidden)

    def materialize(self, device: torch.device | str, dtype: torch.dtype) -> "LlamaModel":
        """Move to the final device/dtype, build the rotary tables there and pack the float
        weights for the CPU's matmuls (`pack_float_weights`)."""
        self.to(device=device, dtype=dtype)
        self.rope = RotaryEmbedding(self.config, device)
        self.pack_float_weights()
        return self

    def pack_float_weights(self) -> None:
        """Make every bfloat16 projection (a float model's, a mixed file's float tensors) and
        a float LM head a PackedLinear where the CPU runs oneDNN: the same products, a
        decode step's in about half the time. A projection's plain weight goes; a tied
        head gets a packed copy of the embedding table. Elsewhere nothing changes. The heap
        the plain weights leave is given back at once (else RSS shows them until a trim)."""
        replaced = False
        for name, module in list(self.named_modules()):
            if isinstance(module, (Linear, FloatLinear)) and packs(module.weight_t):
                packed = PackedLinear(module.weight_t.detach().t(), module.bias)
            elif name == "lm_head" and type(module) is nn.Linear and packs(module.weight):
                packed = PackedLinear(module.weight.detach(), module.bias)
            else:
                continue
            parent, _, attr = name.rpartition(".")
            setattr(self.get_submodule(parent), attr, packed)
            replaced = True
        if replaced:
            heap.trim()

    @torch.no_grad()
    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]], quantization: str = NONE
    ) -> None:
        """Fill parameters from Hugging Face-named tensors; raise on anything missing or unknown.
        q/k/v and gate/up come as separate tensors (Llama, Qwen) or fused (Phi-3).

        With ``quantization`` ``int8`` or ``int4-gN`` every q/k/v/o and MLP projection
        becomes weight-only quantized (weights already in that format are kept as they
        are, others are quantized here), and the LM head int8 where the kernels are fast
        (bfloat16/float16 activations); embeddings and norms stay float.
        """
        params = dict(self.named_parameters())
        fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                 "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}  # fmt: skip
        loaded: set[str] = set()
        shards: dict[str, dict[int | None, QuantizedWeight]] = {}  # quantized linear -> its shards so far
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue
            shard = None
            for part, (target, index) in fused.items():
                if f".{part}." in name:
                    name, shard = name.replace(part, target), index
                    break
            is_linear = name.endswith("_proj.weight")
            if is_linear:  # our Linear keeps [in, out]
                name = name + "_t"
            if name not in params:
                raise KeyError(f"unexpected weight {name!r} in checkpoint")
            # Phi-3 ships qkv_proj and gate_up_proj already fused: one tensor fills every shard
            loaded.update(f"{name}#{s}" for s in ([shard] if shard is not None else self._shard_ids(name)))
            if is_linear and quantization != NONE:
                in_features, out_features = params[name].shape
                rows = out_features if shard is None else self._shard_sizes(name)[shard]
                if tuple(tensor.shape) != (rows, in_features):  # the float path's copy_ checks this
                    raise RuntimeError(f"{hf_name} has shape {tuple(tensor.shape)}, expected {(rows, in_features)}")
                try:
                    shards.setdefault(name.removesuffix(".weight_t"), {})[shard] = convert(tensor, quantization)
                except ValueError as e:
                    raise ValueError(f"cannot load {hf_name} as {quantization}: {e}") from None
                continue
            if is_linear:
                tensor = convert(tensor, NONE).t()
            param = params[name]
            if shard is None:
                param.copy_(tensor)
            else:
                sizes = self._shard_sizes(name)
                start = sum(sizes[:shard])
                param[..., start : start + sizes[shard]].copy_(tensor)
        expected = {f"{n}#{s}" for n in params for s in self._shard_ids(n)}
        if self.config.tie_word_embeddings:
            expected.discard("lm_head.weight#None")
        missing = sorted(expected - loaded)
        if missing:
            raise KeyError(f"checkpoint lacks weights: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
        self.quantization = quantization
        for module_name, parts in shards.items():
            parent_name, _, attr = module_name.rpartition(".")
            parent = self.get_submodule(parent_name)
            bias = getattr(parent, attr).bias
            ordered = [parts[i] for i in sorted(parts, key=lambda i: -1 if i is None else i)]
            try:
                layer = quantized_linear(concat(ordered), None if bias is None else bias.detach())
            except ValueError as e:
                raise ValueError(f"cannot load {module_name} as {quantization}: {e}") from None
            setattr(parent, attr, layer)
        head = self.lm_head.weight
        if quantization != NONE and kernels_apply(head.device, head.dtype):
            # int8, the precision of SmolLM2's Q8_0 tied head: 2-5x faster than bfloat16 for
            # a few sequences' logits, twice as slow for 32: those multiply by the float
            # weight, kept anyway (a tied head's is the embedding table)
            self.lm_head = Int8Linear(quantize_int8(head.detach()), dense=head.detach())

    def _shard_sizes(self, name: str) -> list[int]:
        c = self.config
        if "qkv_proj" in name:
            return [c.q_size, c.kv_size, c.kv_size]
        return [c.intermediate_size, c.intermediate_size]

    def _shard_ids(self, name: str) -> list[int | None]:
        if "qkv_proj" in name:
            return [0, 1, 2]
        if "gate_up_proj" in name:
            return [0, 1]
        return [None]

