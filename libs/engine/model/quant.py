"""Weight-only quantized linear layers on PyTorch's CPU kernels, and every way into them.

Two formats, both with floating activations:

- ``int4-g{32,64,128}``: ``w[n, k] = (q[n, k] - 8) * scale[n, k // g] + zero[n, k // g]``,
  ``q`` in 0..15 (``_weight_int4pack_mm_for_cpu``'s own formula);
- ``int8``: ``w[n, k] = q[n, k] * scale[n]``, one scale per output channel
  (``_weight_int8pack_mm``; bfloat16 rows on one thread: ``kernels/int8_rows.c``).

Weights reach them from GGUF blocks (gguf_blocks.py) or from float weights quantized
at load. ``mixed`` keeps every weight in the format it arrives in, float included:
a fused projection whose parts differ (a GGUF file's q/k in Q4_K, its v in Q6_K)
becomes one layer per part, side by side. The model knows none of this.
"""

import ctypes
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from libs.common.settings import QUANTIZATIONS
from libs.engine.model import native
from libs.engine.model.dense import DenseWeight, FloatLinear

NONE = "none"
AUTO = "auto"
INT8 = "int8"
MIXED = "mixed"  # not a choice: what ``auto`` resolves to for a file that mixes formats
DEFAULT_INT4_GROUP = 32
CHOICES = QUANTIZATIONS  # auto, none, int8, int4 (= int4-g32), int4-g32/64/128

# The kernels run only on the CPU and are fast only with bfloat16/float16 activations
# (float32 takes their scalar path, 10-100x slower). They read half (int4) or a quarter
# (int8) of bfloat16's bytes but their cost grows with every row, where a BLAS matmul's
# barely does: one sequence's int4 projections run in a third of bfloat16's time, eight
# rows in about the same, 32 rows in twice it (576x960, 576x3072 and 1536x576 on one
# Zen core; the int8 LM head crosses at the same size). Above these rows a layer
# multiplies by its weight dequantized once and kept.
KERNEL_MAX_ROWS = 8
_KERNEL_DTYPES = (torch.bfloat16, torch.float16)
_INT4_PACK_N = 16  # _convert_weight_to_int4pack_for_cpu needs N divisible by this
_INT4_INNER_K_TILES = 2  # ignored on the CPU; part of the op's signature
_INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu.default
_INT8_MM = torch.ops.aten._weight_int8pack_mm.default
_INT8_ROW_MAX_K = 16384  # kernels/int8_rows.c's MAX_K
# _weight_int8pack_mm reads past a row whose length is not a multiple of this: wrong
# values, or a crash (torch 2.13, AVX-512). Such a layer multiplies by its dequantized weight.
_INT8_K_MULTIPLE = 16


# Where the native int8 kernel takes more than one row: a weight this large is read from
# memory, not cache, and reading it once for every row is what wins (the default model's
# 28 MB LM head: 2.4 against 4.9 ms for two rows, 7.0 against 11.1 for eight). A weight
# that fits in cache (576x3072, 1.7 MB) ran as fast on torch's kernel, or faster.
_INT8_ROWS_MIN_BYTES = 8 << 20


@functools.cache
def _int8_rows_kernel(f32: bool = False) -> Callable | None:
    """``kernels/int8_rows.c``'s ``int8_rows`` (``int8_rows_f32`` with ``f32``: float32
    results), or None (no compiler, or native kernels off)."""
    lib = native.load("int8_rows")
    if lib is None:
        return None
    fn = lib.int8_rows_f32 if f32 else lib.int8_rows
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * (4 if f32 else 3)  # int8_rows_f32: and its threads
    fn.restype = ctypes.c_int
    return fn


def _int8_rows_take(x: torch.Tensor, weight_q: torch.Tensor) -> bool:
    """Whether ``kernels/int8_rows.c`` serves these rows (see ``_int8_mm``)."""
    m = x.shape[0]
    return (m == 1 or (m <= KERNEL_MAX_ROWS and weight_q.numel() >= _INT8_ROWS_MIN_BYTES)) \
        and x.dtype == torch.bfloat16 and weight_q.shape[1] <= _INT8_ROW_MAX_K and torch.get_num_threads() == 1 \
        and not torch.compiler.is_compiling()  # fmt: skip


def _int8_mm(x: torch.Tensor, weight_q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``_weight_int8pack_mm(x, weight_q, scale)`` on contiguous rows of the scale's dtype.
    Where torch runs on one thread, as `kvserve up` gives each worker on a 2-core machine,
    bfloat16 rows go to ``kernels/int8_rows.c``: one row (a decode step of one sequence)
    for any weight, up to KERNEL_MAX_ROWS for a weight larger than the cache (the LM head).
    torch's kernel is bound by its arithmetic there; this one reads the weight once for all
    the rows, about twice as fast (the default model's int8 LM head: 1.9 against 3.8 ms for
    one row), summing in another order (within one bfloat16 rounding of torch's; a row's
    result the same whatever the rows beside it)."""
    if _int8_rows_take(x, weight_q):
        kernel = _int8_rows_kernel()
        if kernel is not None:
            (m, k), n = x.shape, weight_q.shape[0]
            y = torch.empty(m, n, dtype=x.dtype)
            if kernel(x.data_ptr(), weight_q.data_ptr(), scale.data_ptr(), y.data_ptr(), m, n, k) == 0:
                return y
    return _INT8_MM(x, weight_q, scale)


def parse(spec: str) -> str:
    """The canonical name of a quantization spec: ``auto``, ``none``, ``int8`` or ``int4-gN``."""
    spec = spec.strip().lower()
    if spec == "int4":
        return f"int4-g{DEFAULT_INT4_GROUP}"
    if spec not in CHOICES:
        raise ValueError(f"unknown quantization {spec!r}; choose {', '.join(CHOICES)}")
    return spec


def kernels_apply(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether quantized weights run fast here: what ``auto`` asks before keeping them."""
    return device.type == "cpu" and dtype in _KERNEL_DTYPES


def int4_group_size(name: str) -> int | None:
    """The group size of an ``int4-gN`` name, None for any other."""
    return int(name.removeprefix("int4-g")) if name.startswith("int4-g") else None


# --- quantized weights, before packing ----------------------------------------


@dataclass
class Int4Groups:
    """``[N, K]`` weight: ``w = (q - 8) * scale + zero`` with one scale and zero per ``group_size`` columns."""

    q: torch.Tensor  # uint8 [N, K], values 0..15
    scale: torch.Tensor  # float32 [N, K / group_size]
    zero: torch.Tensor  # float32 [N, K / group_size]
    group_size: int

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def name(self) -> str:
        return f"int4-g{self.group_size}"

    def rows(self, index: torch.Tensor) -> "Int4Groups":
        return Int4Groups(*(t.index_select(0, index) for t in (self.q, self.scale, self.zero)), self.group_size)

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        groups = self.q.view(n, k // self.group_size, self.group_size).float() - 8  # [N, K/g, g]
        return (groups * self.scale[..., None] + self.zero[..., None]).view(n, k)


@dataclass
class Int8Channels:
    """``[N, K]`` weight: ``w = q * scale`` with one scale per output row."""

    q: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # float32 [N]

    name = INT8

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def rows(self, index: torch.Tensor) -> "Int8Channels":
        return Int8Channels(self.q.index_select(0, index), self.scale.index_select(0, index))

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale[:, None]


@dataclass
class Stacked:
    """Weights in different formats (float among them) stacked along the output dimension."""

    parts: list["torch.Tensor | Int4Groups | Int8Channels"]

    name = MIXED

    @property
    def shape(self) -> torch.Size:
        return torch.Size((sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]))

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p if isinstance(p, torch.Tensor) else p.dequantize() for p in self.parts])


QuantizedWeight = Int4Groups | Int8Channels | Stacked


def quantize_int4(w: torch.Tensor, group_size: int) -> Int4Groups:
    """Asymmetric min/max per group (Q4_1's rule, in the kernel's ``(q - 8)`` form)."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"int4-g{group_size} needs in_features divisible by {group_size}, got {k}")
    groups = w.float().view(n, k // group_size, group_size)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    q = ((groups - low[..., None]) / scale[..., None]).round_().clamp_(0, 15).to(torch.uint8)
    return Int4Groups(q.view(n, k), scale, low + 8 * scale, group_size)


def quantize_int8(w: torch.Tensor) -> Int8Channels:
    """Symmetric, one scale per output row."""
    w = w.float()
    scale = (w.abs().amax(-1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    return Int8Channels((w / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8), scale)


def convert(weight: torch.Tensor | QuantizedWeight, target: str) -> torch.Tensor | QuantizedWeight:
    """``weight`` in the ``target`` format (``none``, ``int8``, ``int4-gN``); kept as is when it
    already is, and always under ``mixed``."""
    if target == NONE:
        return weight if isinstance(weight, torch.Tensor) else weight.dequantize()
    if target == MIXED or (not isinstance(weight, torch.Tensor) and weight.name == target):
        return weight
    dense = weight if isinstance(weight, torch.Tensor) else weight.dequantize()
    group = int4_group_size(target)
    return quantize_int8(dense) if group is None else quantize_int4(dense, group)


def concat(parts: Sequence[torch.Tensor | QuantizedWeight]) -> torch.Tensor | QuantizedWeight:
    """Stack weights along the output dimension (fused q/k/v, gate/up): one weight where
    they share a format, ``Stacked`` where they do not."""
    first = parts[0]
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(list(parts))
    if all(isinstance(p, Int4Groups) and p.group_size == first.group_size for p in parts):
        return Int4Groups(
            torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
            torch.cat([p.zero for p in parts]), first.group_size,
        )  # fmt: skip
    if all(isinstance(p, Int8Channels) for p in parts):
        return Int8Channels(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]))
    return Stacked([q for p in parts for q in (p.parts if isinstance(p, Stacked) else [p])])


# --- layers -------------------------------------------------------------------


class Int4Linear(nn.Module):
    """``y = x W^T + b`` with W in int4 groups. Keeps the kernel's packing and a plain
    nibble copy (half a byte per weight each) to dequantize from at prefill sizes."""

    def __init__(self, weight: Int4Groups, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        n, k = weight.shape
        if n % _INT4_PACK_N:
            raise ValueError(f"int4 needs out_features divisible by {_INT4_PACK_N}, got {n}")
        self.out_features, self.in_features, self.group_size = n, k, weight.group_size
        q = weight.q.contiguous()
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), _INT4_INNER_K_TILES))
        self.register_buffer("nibbles", q[:, 0::2] | (q[:, 1::2] << 4))  # uint8 [N, K/2]
        scale_zero = torch.stack((weight.scale.t(), weight.zero.t()), dim=-1)  # [K/g, N, 2]
        self.register_buffer("scale_zero", scale_zero.contiguous())  # cast with the model's dtype
        self.bias = nn.Parameter(bias.clone()) if bias is not None else None
        self._dense: DenseWeight | None = None  # made at the first prefill-sized batch

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:  # [N, K]
        n, k, g = self.out_features, self.in_features, self.group_size
        scale, zero = self.scale_zero.to(dtype).permute(1, 0, 2).unbind(-1)  # [N, K/g] each
        offset = zero - 8 * scale  # (q - 8) * scale + zero == q * scale + offset: two in-place passes
        q = torch.stack((self.nibbles & 0x0F, self.nibbles >> 4), dim=-1).view(n, k // g, g).to(dtype)
        return q.mul_(scale[..., None]).add_(offset[..., None]).view(n, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.in_features)
        if x.shape[0] <= KERNEL_MAX_ROWS and x.dtype in _KERNEL_DTYPES and x.dtype == self.scale_zero.dtype:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, self.group_size, self.scale_zero)
        else:
            y = self.dense(x.dtype)(x)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)


    def row_op(self, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """``forward`` for at most KERNEL_MAX_ROWS contiguous ``dtype`` rows, as one kernel
        call without its checks (for callers that run many small steps); None when the
        kernel does not take ``dtype`` here."""
        if dtype not in _KERNEL_DTYPES or dtype != self.scale_zero.dtype:
            return None
        op, packed, group, scale_zero, bias = _INT4_MM, self.packed, self.group_size, self.scale_zero, self.bias
        if bias is None:
            return lambda x: op(x, packed, group, scale_zero)
        return lambda x: op(x, packed, group, scale_zero).add_(bias)

    def dense(self, dtype: torch.dtype) -> DenseWeight:
        """The weight dequantized, kept after its first use: dequantizing costs about what
        the prefill matmul itself does, so prefill-sized batches pay it once per process
        (float weights' bytes again in memory) instead of every chunk."""
        if self._dense is None or not self._dense.serves(dtype, self.packed.device):
            self._dense = DenseWeight(self.dequantize(dtype), transposed=True)
        return self._dense


class Int8Linear(nn.Module):
    """``y = x W^T + b`` with W in int8, one scale per output channel. ``dense`` is the
    float weight ([N, K]) when the caller keeps one anyway (a tied LM head is the
    embedding table): large batches multiply by it instead of a dequantized copy."""

    def __init__(
        self, weight: Int8Channels, bias: torch.Tensor | None = None, dense: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight_q", weight.q.contiguous())  # int8 [N, K]
        self.register_buffer("scale", weight.scale.clone())  # [N], cast with the model's dtype
        self.bias = nn.Parameter(bias.clone()) if bias is not None else None
        self._given = dense  # [N, K]
        self._dense: DenseWeight | None = None  # made at the first large batch, from the given weight if any

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:  # [N, K]
        return self.weight_q.to(dtype) * self.scale.to(dtype)[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.in_features)
        if x.shape[0] <= KERNEL_MAX_ROWS and self._kernel_takes(x.dtype):
            y = _int8_mm(x.contiguous(), self.weight_q, self.scale)
        else:
            y = self.dense(x.dtype)(x)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """``forward(x)`` in float32, as an LM head's logits: unrounded from the native kernel
        for up to KERNEL_MAX_ROWS bfloat16 rows, on torch's threads; else ``forward``'s values
        made float32. Rounded to bfloat16 (a step of 0.125 between 16 and 32), two close
        logits often tie and greedy decoding takes the lower token id, not the model's choice."""
        x = x.reshape(-1, self.in_features)
        m = x.shape[0]
        if self.bias is None and m <= KERNEL_MAX_ROWS and x.dtype == torch.bfloat16 and self._kernel_takes(x.dtype) \
                and self.in_features <= _INT8_ROW_MAX_K and not torch.compiler.is_compiling():  # fmt: skip
            kernel = _int8_rows_kernel(f32=True)
            if kernel is not None:
                x = x.contiguous()
                y = torch.empty(m, self.out_features, dtype=torch.float32)
                if kernel(x.data_ptr(), self.weight_q.data_ptr(), self.scale.data_ptr(), y.data_ptr(), m,
                          self.out_features, self.in_features, torch.get_num_threads()) == 0:  # fmt: skip
                    return y
        return self.forward(x).float()

    def row_op(self, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """As Int4Linear.row_op."""
        if not self._kernel_takes(dtype):
            return None
        op, weight_q, scale, bias = _int8_mm, self.weight_q, self.scale, self.bias
        if bias is None:
            return lambda x: op(x, weight_q, scale)
        return lambda x: op(x, weight_q, scale).add_(bias)

    def _kernel_takes(self, dtype: torch.dtype) -> bool:
        return dtype in _KERNEL_DTYPES and dtype == self.scale.dtype and self.in_features % _INT8_K_MULTIPLE == 0

    def dense(self, dtype: torch.dtype) -> DenseWeight:
        device, given = self.weight_q.device, self._given
        if self._dense is None or not self._dense.serves(dtype, device):
            usable = given is not None and given.dtype == dtype and given.device == device
            self._dense = DenseWeight(given if usable else self.dequantize(dtype), transposed=False)
        return self._dense


class StackedLinear(nn.Module):
    """One fused projection whose parts are kept in different formats: a layer per part,
    their outputs side by side in the parts' order."""

    def __init__(self, weight: Stacked, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        sizes = [p.shape[0] for p in weight.parts]
        self.out_features, self.in_features = weight.shape
        biases = bias.split(sizes) if bias is not None else [None] * len(sizes)
        self.parts = nn.ModuleList(quantized_linear(p, b) for p, b in zip(weight.parts, biases))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)

    def row_op(self, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """As Int4Linear.row_op: each part's op, the outputs concatenated; None if a part has none."""
        ops = [part.row_op(dtype) for part in self.parts]
        if any(op is None for op in ops):
            return None
        return lambda x: torch.cat([op(x) for op in ops], dim=-1)


def quantized_linear(weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None) -> nn.Module:
    """The layer for ``weight``'s format (a float weight: ``FloatLinear``)."""
    if isinstance(weight, torch.Tensor):
        return FloatLinear(weight, bias)
    if isinstance(weight, Stacked):
        return StackedLinear(weight, bias)
    return Int4Linear(weight, bias) if isinstance(weight, Int4Groups) else Int8Linear(weight, bias)
