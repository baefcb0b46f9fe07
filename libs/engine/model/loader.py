"""Builds a ready model and engine from a model spec: resolve, read, load, place.

``quantization`` names the weights' precision (quant.py): ``auto`` keeps what the
checkpoint ships (the default model's GGUF: int4 in groups of 32; a GGUF file of
several block types: ``mixed``, each weight in its own format), ``none`` loads
float, ``int8`` and ``int4-gN`` quantize at load. ``dtype`` is the activations' and
the KV cache's.
"""

import functools
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from libs.engine.model import quant
from libs.engine.model.checkpoint import Checkpoint, open_checkpoint
from libs.engine.model.default_model import (
    check_default_intact,
    default_gguf_path,
    resolve_model_path,
)
from libs.engine.model.engine import Engine, EngineConfig
from libs.engine.model.kv_cache import KVCacheManager
from libs.engine.model.kv_pool import KVLayout, KVPool
from libs.engine.model.llama import LlamaModel
from libs.engine.model.tokenizer import Tokenizer
from libs.protocol.errors import ModelCorruptError
from libs.protocol.hashing import model_extra
from libs.protocol.models import DEFAULT_MODEL_ID

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device, hidden_size: int = 576, intermediate_size: int = 1536) -> torch.dtype:
    """``auto`` picks the faster of bfloat16 and float32 on this hardware.

    CUDA always gets bfloat16. On a CPU, bfloat16 wins where it has fast dot-product
    instructions (1.5-2.8x on AVX512-BF16 Zen 5) but loses where it is converted
    on the fly (some Xeons without AMX run it at half fp32 speed), so a short
    matmul of the model's own shape decides, once per process.
    """
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        if device.type != "cpu" or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return torch.float32
        return torch.bfloat16 if _bf16_is_faster(hidden_size, intermediate_size) else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[name]


@functools.cache
def _bf16_is_faster(hidden_size: int, intermediate_size: int) -> bool:
    times = {}
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(128, hidden_size, dtype=dtype)
            w = torch.randn(intermediate_size, hidden_size, dtype=dtype)
            F.linear(x, w)
            best = float("inf")
            for _ in range(5):
                start = time.perf_counter()
                F.linear(x, w)
                best = min(best, time.perf_counter() - start)
            times[dtype] = best
    return times[torch.bfloat16] * 1.1 < times[torch.float32]


@dataclass
class LoadedModel:
    model: LlamaModel
    tokenizer: Tokenizer
    checkpoint: Checkpoint
    device: torch.device
    dtype: torch.dtype
    quantization: str = quant.NONE  # what the weights run in: none, int8, int4-gN or mixed

    @property
    def model_id(self) -> str:
        return self.checkpoint.model_id

    def kv_layout(self, block_size: int) -> KVLayout:
        c = self.model.config
        return KVLayout(c.num_layers, block_size, c.num_kv_heads, c.head_dim, self.dtype)


def open_model(
    spec: str | None, quantization: str = quant.AUTO, device: str = "cpu", dtype: str = "auto", progress: bool = True
) -> tuple[Checkpoint, str, torch.dtype]:
    """The checkpoint to load ``spec`` from, the quantization and the activation dtype it runs with.

    ``auto`` keeps the precision the weights ship in where the int kernels are fast (a
    CPU with bfloat16/float16 activations) and loads float elsewhere. The default
    model's prepared folder holds float32; quantized, it loads from its GGUF file,
    whose Q4_1 blocks go into the int4 kernel's format unrounded.
    """
    requested = quant.parse(quantization)
    path, model_id = resolve_model_path(spec, progress=progress)
    checkpoint = open_checkpoint(path, model_id)
    dev = torch.device(device)
    config = checkpoint.config
    torch_dtype = resolve_dtype(dtype, dev, config.hidden_size, config.intermediate_size)
    if requested == quant.AUTO and not quant.kernels_apply(dev, torch_dtype):
        requested = quant.NONE
    if requested != quant.NONE and dev.type != "cpu":
        raise ValueError(f"quantization {requested!r} runs on the CPU only, not on {device!r}: use none")
    if model_id == DEFAULT_MODEL_ID and requested != quant.NONE:
        checkpoint = open_checkpoint(default_gguf_path(), model_id)
    if requested == quant.AUTO:
        requested = checkpoint.native_quantization()
    return checkpoint, requested, torch_dtype


def load_model(
    spec: str | None = None,
    device: str = "cpu",
    dtype: str = "auto",
    progress: bool = True,
    quantization: str = quant.AUTO,
) -> LoadedModel:
    """Load a model by spec (None or the default's id, a HF folder, a .gguf file)."""
    checkpoint, quantization, torch_dtype = open_model(spec, quantization, device, dtype, progress)
    path, model_id = checkpoint.path, checkpoint.model_id
    dev = torch.device(device)
    config = checkpoint.config
    try:
        with torch.device("meta"):
            model = LlamaModel(config)
        model.to_empty(device=dev)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        model.to(dtype=torch_dtype)
        model.load_weights(checkpoint.tensors(keep_quantized=quantization != quant.NONE), quantization)
        tokenizer = checkpoint.tokenizer()
    except (ModelCorruptError, KeyError, RuntimeError) as e:
        if model_id == DEFAULT_MODEL_ID:
            raise check_default_intact(path, e) from e
        if isinstance(e, ModelCorruptError):
            raise
        raise ModelCorruptError(f"cannot load {path}: {e}") from e
    model.materialize(dev, torch_dtype)
    model.eval()
    return LoadedModel(model, tokenizer, checkpoint, dev, torch_dtype, quantization)


def build_engine(loaded: LoadedModel, config: EngineConfig, pool_buffer: torch.Tensor | None = None) -> Engine:
    """An engine with a fresh KV pool (or one viewed over ``pool_buffer``, e.g. shared memory)."""
    layout = loaded.kv_layout(config.block_size)
    pool = KVPool(layout, config.num_blocks, loaded.device, buffer=pool_buffer)
    cache = KVCacheManager(config.num_blocks, config.block_size, model_extra(loaded.model_id), config.enable_prefix_cache)
    return Engine(loaded.model, pool, cache, config)
