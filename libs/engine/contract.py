"""The KV contract a process declares: model and the precision of its weights, block
size, block layout and hash scheme.

Two holders of KV blocks (workers, stores) exchange blocks only when their
contracts are equal; the first difference is named in the error, so a
mismatch can never show up as a silent 0% cache hit rate.
"""

import torch

from libs.engine.model.config import ModelConfig
from libs.engine.model.kv_pool import KVLayout
from libs.protocol.hashing import HASH_SCHEME
from libs.protocol.schema import KVContract


def kv_layout(config: ModelConfig, block_size: int, dtype: torch.dtype) -> KVLayout:
    return KVLayout(config.num_layers, block_size, config.num_kv_heads, config.head_dim, dtype)


def make_contract(model_id: str, layout: KVLayout, quantization: str = "none") -> KVContract:
    return KVContract(model_id=model_id, block_size=layout.block_size, layout=layout.describe(), hash_scheme=HASH_SCHEME,
                      quantization=quantization)  # fmt: skip
