"""Float weights for the matmuls: plain (``FloatLinear``: a mixed file's float tensors)
or kept in oneDNN's own blocked layout (``DenseWeight`` for the quantized layers' large
batches, ``PackedLinear`` for a bfloat16 float model's projections). torch reorders a
plain bfloat16 weight into that layout at every call; packed once, the products are the
same to the bit.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def _onednn_linear():
    """oneDNN's linear on a weight reordered once (what torch.compile's CPU backend calls),
    or None where this torch lacks it."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight.default, torch.ops.mkldnn._linear_pointwise.default
    except (AttributeError, RuntimeError):
        return None


_ONEDNN = _onednn_linear()
_PACK_ROWS_HINT = 256  # the batch the reordered layout is chosen for: a prefill chunk's rows


def packs(weight: torch.Tensor) -> bool:
    """Whether a float weight is kept in oneDNN's layout here (bfloat16, on a CPU torch has oneDNN for)."""
    return _ONEDNN is not None and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"


@torch.library.custom_op("kvserve::packed_linear", mutates_args=())
def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's linear as an opaque op for torch.compile: Inductor's own lowering of it
    takes only weights frozen into the graph, and a packed weight is not."""
    return _ONEDNN[1](x, packed, bias, "none", [], "")


@_packed_linear.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], packed.shape[0])


class DenseWeight:
    """A layer's float weight (``[N, K]``) for batches too large for the quantized kernels:
    ``x W^T`` by a call. In bfloat16, where torch has oneDNN, the weight is kept in
    oneDNN's own blocked layout: a plain tensor is reordered into it at every call, which
    here cost 4-12% of a 256-2,048-row projection, a third of a 16-row one and 40% of the
    LM head's time at 32 rows (the same products to the bit). Elsewhere the weight as the
    layer multiplied by it before: ``[K, N]`` (``transposed``) or ``[N, K]``."""

    def __init__(self, weight: torch.Tensor, transposed: bool) -> None:
        self.dtype, self.device, self.out_features = weight.dtype, weight.device, weight.shape[0]
        self.transposed = transposed
        self.packed = self.weight = None
        if packs(weight):
            self.packed = _ONEDNN[0](weight.contiguous(), _PACK_ROWS_HINT)
        else:
            self.weight = weight.t().contiguous() if transposed else weight

    def serves(self, dtype: torch.dtype, device: torch.device) -> bool:
        return self.dtype == dtype and self.device == device

    @property
    def is_packed(self) -> bool:
        return self.packed is not None

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:  # [M, K] -> [M, N]
        if self.packed is not None:
            if x.shape[0] == 0:  # nothing for oneDNN to do
                return x.new_empty(0, self.out_features)
            if torch.compiler.is_compiling():
                return _packed_linear(x.contiguous(), self.packed, bias)
            return _ONEDNN[1](x.contiguous(), self.packed, bias, "none", [], "")  # the bias as addmm adds it
        if self.transposed:
            return x @ self.weight if bias is None else torch.addmm(bias, x, self.weight)
        return F.linear(x, self.weight, bias)


class FloatLinear(nn.Module):
    """``y = x W^T + b`` with a float W, kept ``[K, N]`` as llama.Linear keeps it: a weight
    that a ``mixed`` model loads float (a GGUF type the kernels cannot hold)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight_t = nn.Parameter(weight.t().contiguous())  # [K, N]
        self.bias = nn.Parameter(bias.clone()) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.in_features)
        y = x @ self.weight_t if self.bias is None else torch.addmm(self.bias, x, self.weight_t)
        return y.view(*shape[:-1], self.out_features)

    def row_op(self, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """As Int4Linear.row_op."""
        return float_row_op(self.weight_t, self.bias, dtype)


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with a bfloat16 W kept only in oneDNN's blocked layout
    (DenseWeight): what ``LlamaModel.pack_float_weights`` makes of every float projection
    and float LM head on a CPU. The same products as the plain weight's, to the bit (the
    bias added as addmm adds it), in about half the time for a few rows: torch reorders a
    plain weight into that layout at every call (`bench/dense_weights.py`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:  # weight [N, K]
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = DenseWeight(weight.contiguous(), transposed=False)
        if not self.weight.is_packed:
            raise ValueError(f"oneDNN cannot pack a {weight.dtype} weight on {weight.device}")
        self.bias = nn.Parameter(bias.detach().clone()) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self.weight(x.reshape(-1, self.in_features), self.bias)
        return y.view(*shape[:-1], self.out_features)

    def row_op(self, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """As Int4Linear.row_op."""
        if not self.weight.serves(dtype, torch.device("cpu")):
            return None
        weight, bias = self.weight, self.bias
        return lambda x: weight(x, bias)


def float_row_op(weight_t: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor] | None:  # fmt: skip
    """``x W^T + b`` for 2-D ``dtype`` rows, W kept ``[K, N]``, without a module's dispatch;
    None when the weight is in another dtype."""
    if weight_t.dtype != dtype:
        return None
    if bias is None:
        return lambda x: torch.mm(x, weight_t)
    return lambda x: torch.addmm(bias, x, weight_t)
