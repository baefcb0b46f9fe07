"""Prefill tokens/s with the native prefill attention against gather + SDPA, side by
side in one process, with the default model (int4 weights, bfloat16 activations and
KV), and where prefill stands against this machine's GEMM roofline.

    .venv/bin/python bench/prefill_attention.py [--lengths 512,2048,8192] [--reps 3] [--out FILE]

Each prompt length is prefilled in 256-token steps, as a prefill worker runs it
(KVSERVE_MAX_CHUNK_TOKENS' default), and 2,048 also in one step; the two attention
paths alternate repetition by repetition so that a busy machine slows both alike.
The roofline: the model's FLOPs per prefilled token (its projections, and causal
attention over the prompt's average context) over the FLOP/s torch.mm reaches on
the model's own projection shapes, measured in the same run.
"""

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

from libs.engine.model import steps

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORKER_CHUNK = 256  # services/prefill/settings.py's default step


def gemm_flops(config, dtype, rows: int = 2048, reps: int = 5) -> float:
    """FLOP/s of torch.mm on one layer's projections ([rows, in] @ [in, out], as the model
    multiplies), their FLOPs over their summed best times."""
    import torch

    shapes = [(config.hidden_size, config.q_size + 2 * config.kv_size), (config.q_size, config.hidden_size),
              (config.hidden_size, 2 * config.intermediate_size), (config.intermediate_size, config.hidden_size)]  # fmt: skip
    flops = seconds = 0.0
    for k, n in shapes:
        a, b = torch.randn(rows, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        torch.mm(a, b)
        best = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - start)
        flops += 2 * rows * k * n
        seconds += best
    return flops / seconds


def flops_per_token(config, length: int) -> float:
    """Projections (2 FLOPs per weight) plus causal attention (q k^T and p v over the
    prompt's average context, (length + 1) / 2), per layer, per prefilled token."""
    c = config
    weights = c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    attention = 4 * c.num_heads * c.head_dim * (length + 1) / 2
    return c.num_layers * (2 * weights + attention)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="512,2048,8192")
    ap.add_argument("--reps", type=int, default=3, help="repetitions per row and path (median; past 4,096 tokens: one)")
    ap.add_argument("--out", type=Path, default=None, help="append the table to this file")
    args = ap.parse_args()

    import torch

    from libs.engine.model import attention
    from libs.engine.model.engine import EngineConfig
    from libs.engine.model.loader import build_engine, load_model
    from libs.engine.model.sequence import Sequence

    torch.set_grad_enabled(False)
    loaded = load_model(None, dtype="bfloat16", progress=False)  # what `auto` picks on AVX512-BF16
    config = loaded.model.config
    if attention._load_prefill_kernel() is None:
        print("the native prefill kernel cannot be built here: nothing to compare")
        return 1
    peak = gemm_flops(config, loaded.dtype)
    print(f"torch.mm on the projections' shapes: {peak / 1e9:.0f} GFLOP/s ({loaded.dtype})", flush=True)
    lengths = [int(x) for x in args.lengths.split(",")]
    rows = [(n, WORKER_CHUNK) for n in lengths if n <= 4096] + ([(2048, 2048)] if 2048 in lengths else [])
    rows += [(n, WORKER_CHUNK) for n in lengths if n > 4096]  # the slowest last
    engines = {}
    results = []
    for n, chunk in rows:
        warm = chunk in engines
        if not warm:
            engines[chunk] = build_engine(loaded, EngineConfig(num_blocks=max(lengths) // 16 + 64, max_chunk_tokens=chunk,
                                                               enable_prefix_cache=False))  # fmt: skip
        engine = engines[chunk]
        ids = torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(n)).tolist()

        def prefill(path: str) -> tuple[float, torch.Tensor]:
            attention.prefill_path = path
            seq = Sequence.from_prompt(f"{path}-{n}", ids)
            start = time.perf_counter()
            logits = steps.prefill(engine, [seq])
            elapsed = time.perf_counter() - start
            engine.cache.free(seq)
            return n / elapsed, logits

        if not warm:  # an engine's first prefill builds the bfloat16 weights and loads the kernel
            prefill("native")
        times: dict[str, list[float]] = {"sdpa": [], "native": []}
        logits = {}
        for _ in range(1 if n > 4096 else args.reps):
            for path in times:
                rate, logits[path] = prefill(path)
                times[path].append(rate)
        sdpa, native = statistics.median(times["sdpa"]), statistics.median(times["native"])
        diff = (logits["native"] - logits["sdpa"]).abs().max().item()
        roof = peak / flops_per_token(config, n)
        results.append((n, chunk, sdpa, native, roof, diff, len(times["sdpa"])))
        print(f"{n} tokens, steps of {chunk}: SDPA {sdpa:.0f} tok/s, native {native:.0f} tok/s ({native / sdpa:.2f}x); "
              f"roofline {roof:.0f} tok/s; last-token logits differ by {diff:.3f}", flush=True)  # fmt: skip
    attention.prefill_path = "native"
    lines = [
        "",
        f"### Prefill attention, native vs SDPA ({datetime.datetime.now().strftime('%Y-%m-%d %H:%M')} UTC)",
        "",
        f"- command: `python {' '.join(sys.argv)}`",
        f"- {os.cpu_count()} cores; torch.mm on the projections' shapes ({loaded.dtype}): {peak / 1e9:.0f} GFLOP/s",
        "",
        "| prompt | step | SDPA tok/s | native tok/s | native / SDPA | roofline tok/s | native / roofline | reps |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n, chunk, sdpa, native, roof, diff, reps in results:
        lines.append(f"| {n} | {chunk} | {sdpa:.0f} | {native:.0f} | {native / sdpa:.2f}x | {roof:.0f} | "
                     f"{native / roof:.0%} | {reps} |")  # fmt: skip
    for n in lengths:
        lines.append(f"- FLOPs per prefilled token at {n}: {flops_per_token(config, n) / 1e6:.0f} M")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
