"""Decode attention over the paged KV pool: the native C kernel against PyTorch's
gather + SDPA, eager and compiled by Inductor, on the default model's shapes.

    .venv/bin/python bench/attention.py [--reps 20]

Prints the best time of each path for batch 1/8/32 and context 128-2048 (bf16),
measured side by side in one run; the paths must agree to bf16 rounding.
"""

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's, not the installed one

from libs.engine.model import attention  # noqa: E402
from libs.engine.model.kv_pool import KVLayout, KVPool  # noqa: E402

LAYERS, BLOCK, KV_HEADS, HEADS, DIM, LAYER, SCALE = 30, 16, 3, 9, 64, 5, 0.125


def sdpa(q: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    pool = KVPool.over(kv)
    batch = attention.AttentionBatch(None, None, decode_block_tables=tables, decode_lens=lens)
    keys = pool.gather(LAYER, 0, tables).flatten(1, 2).transpose(1, 2)  # [B, Hkv, S, D]
    values = pool.gather(LAYER, 1, tables).flatten(1, 2).transpose(1, 2)
    mask = torch.arange(keys.shape[2]) < batch.decode_lens[:, None]
    qh = q.view(q.shape[0], KV_HEADS, HEADS // KV_HEADS, DIM)
    return F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask[:, None, None, :], scale=SCALE)


def best_us(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e6


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    kernel = attention._load_kernel()
    compiled = torch.compile(sdpa, dynamic=False)
    print(f"{'batch':>5} {'context':>7} {'C kernel':>10} {'SDPA':>10} {'SDPA compiled':>14}  (µs, best of {args.reps})")
    for batch in (1, 8, 32):
        for context in (128, 512, 2048):
            num_blocks = batch * context // BLOCK
            pool = KVPool(KVLayout(LAYERS, BLOCK, KV_HEADS, DIM, torch.bfloat16), num_blocks)
            pool.kv.normal_()
            tables = torch.randperm(num_blocks).view(batch, -1)
            lens = torch.full((batch,), context) - torch.arange(batch) % 7
            q = torch.randn(batch, HEADS, DIM, dtype=torch.bfloat16)
            out = torch.empty_like(q)

            def native():
                kernel(q.data_ptr(), pool.kv.data_ptr(), tables.data_ptr(), lens.data_ptr(), out.data_ptr(), batch,
                       HEADS, KV_HEADS, DIM, BLOCK, LAYERS, LAYER, tables.shape[1], SCALE, 1)  # fmt: skip

            reference = sdpa(q, pool.kv, tables, lens).reshape_as(q)
            native()
            assert (out.float() - reference.float()).abs().max() < 0.02
            times = [best_us(native, args.reps) if kernel else float("nan"),
                     best_us(lambda: sdpa(q, pool.kv, tables, lens), args.reps),
                     best_us(lambda: compiled(q, pool.kv, tables, lens), args.reps)]  # fmt: skip
            print(f"{batch:>5} {context:>7} {times[0]:>10.0f} {times[1]:>10.0f} {times[2]:>14.0f}", flush=True)


if __name__ == "__main__":
    main()
