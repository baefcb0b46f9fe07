"""The native decode-attention kernel computes what the PyTorch path does: every batch
size, sequence lengths on and off block boundaries, padded block tables, float32 and
bfloat16, on one thread and on several."""

import pytest
import torch

from libs.engine.model import attention
from libs.engine.model.attention import AttentionBatch
from libs.engine.model.kv_pool import KVLayout, KVPool

LAYERS, BLOCK, KV_HEADS, Q_HEADS, DIM = 3, 16, 3, 9, 64


def decode(q: torch.Tensor, pool: KVPool, batch: AttentionBatch, native: bool, monkeypatch) -> torch.Tensor:
    with monkeypatch.context() as m:
        if not native:
            m.setattr(attention, "_load_kernel", lambda: None)
        return attention._decode_attention(1, q, pool, batch, DIM**-0.5)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 1.6e-2)])  # rtol and atol
@pytest.mark.parametrize("lens", [[1], [16], [17, 5], [200, 33, 64, 1, 90, 128, 7, 300], [260] * 40])
def test_native_kernel_matches_pytorch(dtype, tolerance, lens, monkeypatch):
    if attention._load_kernel() is None:
        pytest.skip("no C compiler: the native kernel cannot be built here")
    gen = torch.Generator().manual_seed(len(lens))
    pool = KVPool(KVLayout(LAYERS, BLOCK, KV_HEADS, DIM, dtype), num_blocks=1 + sum(-(-n // BLOCK) for n in lens) + 8)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=gen) * 2)
    width = max(-(-n // BLOCK) for n in lens) + 2  # padded tables, as a batch has them
    tables = torch.zeros(len(lens), width, dtype=torch.long)
    free = list(torch.randperm(pool.num_blocks - 1, generator=gen) + 1)  # scattered blocks, block 0 the padding
    for row, n in enumerate(lens):
        tables[row, : -(-n // BLOCK)] = torch.tensor([int(free.pop()) for _ in range(-(-n // BLOCK))])
    batch = AttentionBatch(torch.zeros(len(lens), dtype=torch.long), torch.zeros(len(lens), dtype=torch.long),
                           decode_block_tables=tables, decode_lens=torch.tensor(lens))  # fmt: skip
    q = (torch.randn(len(lens), Q_HEADS, DIM, generator=gen) * 2).to(dtype)
    reference = decode(q, pool, batch, native=False, monkeypatch=monkeypatch).float()
    native = decode(q, pool, batch, native=True, monkeypatch=monkeypatch).float()
    torch.testing.assert_close(native, reference, rtol=tolerance, atol=tolerance)  # bf16: an ulp or two
