"""Prefill tokens/s with the native prefill attention against gather + SDPA, side by
side in one process, with the default model (int4 weights, bfloat16 activations and
KV), and where prefill stands against this machine's GEMM roofline.

    .venv/bin/python bench/prefill_attention.py [--lengths 512,2048,8192] [--reps 3] [--out FILE]
    .venv/bin/python bench/prefill_attention.py --accuracy 2048 [--out FILE]

Each prompt length is prefilled in 256-token steps, as a prefill worker runs it
(KVSERVE_MAX_CHUNK_TOKENS' default), and 2,048 also in one step; the two attention
paths alternate repetition by repetition so that a busy machine slows both alike.
The roofline: the model's FLOPs per prefilled token (its projections, and causal
attention over the prompt's average context) over the FLOP/s torch.mm reaches on
the model's own projection shapes, measured in the same run.

``--accuracy N`` measures how far each path's logits stray instead: windows of N tokens
of this repository's own English prose (README and docs) are prefilled in the worker's
256-token steps by both bfloat16 paths and by the same weights in float32 (SDPA), and
at every position each path's logits are compared with float32's: how often its top
token differs, the mean and largest absolute difference, and the mean KL divergence.
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

from libs.engine.model import steps  # noqa: E402

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
    ap.add_argument("--accuracy", type=int, default=0, metavar="N",
                    help="compare both paths' logits with float32's over windows of N tokens instead")
    args = ap.parse_args()
    if args.accuracy:
        return accuracy(args)

    import torch

    from libs.engine.model import attention
    from libs.engine.model.engine import EngineConfig
    from libs.engine.model.loader import build_engine, load_model
    from libs.engine.model.sequence import Sequence

    torch.set_grad_enabled(False)
    attention.NATIVE_MIN_CONTEXT = 1  # every span, short ones too: the engine's threshold is measured here
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
    emit(lines, args.out)
    return 0


def emit(lines: list[str], out: Path | None) -> None:
    """Print the report and append it to ``out``, if given."""
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        with open(out, "a") as f:
            f.write(text)


def accuracy(args) -> int:
    import torch

    from libs.engine.model import attention
    from libs.engine.model.engine import EngineConfig
    from libs.engine.model.loader import build_engine, load_model
    from libs.engine.model.sequence import Sequence

    torch.set_grad_enabled(False)
    attention.NATIVE_MIN_CONTEXT = 1
    if attention._load_prefill_kernel() is None:
        print("the native prefill kernel cannot be built here: nothing to compare")
        return 1
    n = args.accuracy
    text = "\n\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    loaded = {dtype: load_model(None, dtype=dtype, progress=False) for dtype in ("float32", "bfloat16")}
    ids = loaded["float32"].tokenizer.encode(text, add_special_tokens=False)
    windows = [ids[start : start + n] for start in range(0, len(ids) - n + 1, n)]
    print(f"{len(windows)} windows of {n} tokens ({len(ids)} tokens of prose)", flush=True)

    engines = {(dtype, path): build_engine(loaded[dtype], EngineConfig(num_blocks=n // 16 + 64,
                                                                      max_chunk_tokens=WORKER_CHUNK,
                                                                      enable_prefix_cache=False))
               for dtype, path in (("float32", "sdpa"), ("bfloat16", "sdpa"), ("bfloat16", "native"))}  # fmt: skip

    def logits_of(dtype: str, path: str, i: int, window: list[int]) -> torch.Tensor:
        attention.prefill_path = path
        engine = engines[dtype, path]
        seq = Sequence.from_prompt(f"{dtype}-{path}-{i}", window)
        logits = steps.prefill_all_logits(engine, [seq])[0].float()
        engine.cache.free(seq)
        return logits

    # one window at a time: every window's logits at once (three paths x 2,048 positions x
    # the vocabulary, in float32) would not fit in memory
    stats = {path: {"flips": 0, "positions": 0, "mean_abs": 0.0, "worst": 0.0, "kl": 0.0}
             for path in ("sdpa", "native")}  # fmt: skip
    for i, window in enumerate(windows):
        ref = logits_of("float32", "sdpa", i, window)
        logp = ref.log_softmax(-1)
        for path, s in stats.items():
            out = logits_of("bfloat16", path, i, window)
            diff = (out - ref).abs()
            s["flips"] += int((out.argmax(-1) != ref.argmax(-1)).sum())
            s["positions"] += ref.shape[0]
            s["mean_abs"] += float(diff.mean(-1).sum())
            s["worst"] = max(s["worst"], float(diff.max()))
            s["kl"] += float((logp.exp() * (logp - out.log_softmax(-1))).sum(-1).sum())
    rows = []
    for path, s in stats.items():
        flips, positions = s["flips"], s["positions"]
        rows.append((path, flips, positions, s["mean_abs"] / positions, s["worst"], s["kl"] / positions))
        print(f"bfloat16 {path}: top token differs from float32's at {flips} of {positions} positions; "
              f"mean |diff| {s['mean_abs'] / positions:.4f}, max {s['worst']:.3f}, KL {s['kl'] / positions:.2e}",
              flush=True)  # fmt: skip
    lines = [
        "",
        f"### Prefill attention's logits against float32 ({datetime.datetime.now().strftime('%Y-%m-%d %H:%M')} UTC)",
        "",
        f"- command: `python {' '.join(sys.argv)}`",
        f"- {len(windows)} windows of {n} tokens of the README and docs, prefilled in {WORKER_CHUNK}-token steps; "
        "the reference: the same int4 weights with float32 activations and KV (SDPA)",
        "",
        "| bfloat16 path | top token differs | mean abs diff | max abs diff | mean KL (nats) |",
        "|---|---|---|---|---|",
    ]
    for path, flips, positions, mean_abs, worst, kl in rows:
        lines.append(f"| {path} | {flips} of {positions} ({flips / positions:.2%}) | {mean_abs:.4f} | {worst:.3f} | "
                     f"{kl:.2e} |")  # fmt: skip
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
