"""Prefill tokens/s with each layer's small steps fused (libs/engine/model/fused.py,
``FusedForward.prefill``) against the modules of llama.py, side by side in one process,
with the default model (int4 weights, bfloat16 activations and KV), and where each
stands against this machine's GEMM roofline.

    .venv/bin/python bench/fused_prefill.py [--lengths 128,512,2048,8192] [--reps 5] [--out FILE]

Each prompt length is prefilled in 256-token steps, as a prefill worker runs it
(KVSERVE_MAX_CHUNK_TOKENS' default), and 2,048 also in one step, by two engines over
the same loaded model, one with ``fuse_prefill`` and one without; they alternate
repetition by repetition so that a busy machine slows both alike. Both take the same
native prefill attention. The last token's logits of the two are compared: the fused
path promises the modules' values to the bit. The roofline is bench/prefill_attention.py's:
the model's FLOPs per prefilled token over the FLOP/s torch.mm reaches on the model's own
projection shapes in the same run.
"""

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # before any import of the project: this tree's, not the installed one

from bench.prefill_attention import WORKER_CHUNK, emit, flops_per_token, gemm_flops  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="128,512,2048,8192")
    ap.add_argument("--reps", type=int, default=5, help="repetitions per row and path (median; past 4,096 tokens: 2)")
    ap.add_argument("--out", type=Path, default=None, help="append the table to this file")
    args = ap.parse_args()

    import torch

    from libs.engine.model import steps
    from libs.engine.model.engine import EngineConfig
    from libs.engine.model.loader import build_engine, load_model
    from libs.engine.model.sequence import Sequence

    torch.set_grad_enabled(False)
    loaded = load_model(None, dtype="bfloat16", progress=False)  # what `auto` picks on AVX512-BF16
    config = loaded.model.config
    lengths = [int(x) for x in args.lengths.split(",")]
    blocks = max(lengths) // 16 + 64
    ways = ("modules", "fused")
    rows = [(n, WORKER_CHUNK) for n in lengths if n <= 4096] + ([(2048, 2048)] if 2048 in lengths else [])
    rows += [(n, WORKER_CHUNK) for n in lengths if n > 4096]  # the slowest last
    engines = {}
    for chunk in sorted({chunk for _, chunk in rows}):
        for way in ways:
            engines[way, chunk] = build_engine(loaded, EngineConfig(num_blocks=blocks, max_chunk_tokens=chunk,
                                                                    enable_prefix_cache=False,
                                                                    fuse_prefill=way == "fused"))  # fmt: skip
            if way == "fused" and engines[way, chunk].fused is None:
                print("the fused forward cannot run here (no C compiler, or not bfloat16): nothing to compare")
                return 1
    peak = gemm_flops(config, loaded.dtype)
    print(f"torch.mm on the projections' shapes: {peak / 1e9:.0f} GFLOP/s ({loaded.dtype})", flush=True)

    def prefill(way: str, chunk: int, ids: list[int], tag: str) -> tuple[float, torch.Tensor]:
        engine = engines[way, chunk]
        seq = Sequence.from_prompt(f"{way}-{tag}", ids)
        start = time.perf_counter()
        logits = steps.prefill(engine, [seq])
        elapsed = time.perf_counter() - start
        engine.cache.free(seq)
        return len(ids) / elapsed, logits

    warm = torch.randint(100, 40000, (512,), generator=torch.Generator().manual_seed(0)).tolist()
    for way, chunk in engines:  # the first prefill builds the bfloat16 weights and loads the kernels
        prefill(way, chunk, warm, "warm")
    results = []
    for n, chunk in rows:
        ids = torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        times: dict[str, list[float]] = {way: [] for way in ways}
        logits = {}
        for rep in range(2 if n > 4096 else args.reps):
            for way in ways:
                rate, logits[way] = prefill(way, chunk, ids, f"{n}-{chunk}-{rep}")
                times[way].append(rate)
        modules, fused = statistics.median(times["modules"]), statistics.median(times["fused"])
        same = torch.equal(logits["modules"], logits["fused"])
        roof = peak / flops_per_token(config, n)
        results.append((n, chunk, modules, fused, roof, same, len(times["fused"])))
        print(f"{n} tokens, steps of {chunk}: modules {modules:.0f} tok/s, fused {fused:.0f} tok/s "
              f"({fused / modules:.2f}x); roofline {roof:.0f} tok/s; same logits: {same}", flush=True)  # fmt: skip
    lines = [
        "",
        f"### Prefill, fused small steps vs the modules ({datetime.datetime.now().strftime('%Y-%m-%d %H:%M')} UTC)",
        "",
        f"- command: `python {' '.join(sys.argv)}`",
        f"- {os.cpu_count()} cores; torch.mm on the projections' shapes ({loaded.dtype}): {peak / 1e9:.0f} GFLOP/s",
        "",
        "| prompt | step | modules tok/s | fused tok/s | fused / modules | roofline tok/s | fused / roofline "
        "| same logits | reps |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for n, chunk, modules, fused, roof, same, reps in results:
        lines.append(f"| {n} | {chunk} | {modules:.0f} | {fused:.0f} | {fused / modules:.2f}x | {roof:.0f} | "
                     f"{fused / roof:.0%} | {'yes' if same else 'NO'} | {reps} |")  # fmt: skip
    emit(lines, args.out)
    return 0 if all(r[5] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
