"""What a prefill step's size costs and buys, on this machine, with the default model:
the step size (``KVSERVE_MAX_CHUNK_TOKENS``) bounds how long a short prompt that
arrives behind a long one waits (one step), and every step pays a fixed cost.

For each chunk size, side by side in one run and one process: the 2,048-token
prompt prefilled in steps of that size (tokens/s, and against one whole step), and
the time one step of that size takes (the wait it imposes on a newcomer).

    .venv/bin/python bench/prefill_chunks.py --out bench/results/prefill_chunks.md
"""

import argparse
import datetime
import platform
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CHUNKS = (128, 256, 512, 1024, 2048)
PROMPT = 2048


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", default="auto",
                    help="the engine's dtype: auto (what `kvserve up` picks here), bfloat16, float32")
    ap.add_argument("--chunks", type=int, nargs="+", default=list(CHUNKS), help="step sizes to try, in tokens")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    import torch

    from libs.engine.model.engine import EngineConfig
    from libs.engine.model.loader import build_engine, load_model, resolve_dtype
    from libs.engine.model.sequence import Sequence

    torch.set_grad_enabled(False)
    dtype = str(resolve_dtype(args.dtype, torch.device("cpu"))).removeprefix("torch.")
    loaded = load_model(None, dtype=dtype, progress=False)
    engine = build_engine(loaded, EngineConfig(num_blocks=512, max_chunk_tokens=PROMPT, enable_prefix_cache=False))
    vocab = loaded.model.config.vocab_size
    rng = random.Random(0)

    def prompt() -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(PROMPT)]

    def prefill(chunk: int) -> tuple[float, list[float]]:
        """Seconds for the whole prompt in steps of ``chunk`` tokens, and each step's."""
        seq = Sequence.from_prompt("p", prompt())
        engine.cache.allocate(seq, seq.num_tokens)  # the engine only computes
        steps, start = [], time.perf_counter()
        while seq.num_computed_tokens < seq.num_tokens:
            n = min(chunk, seq.num_tokens - seq.num_computed_tokens)
            t = time.perf_counter()
            engine.prefill_chunk([(seq, n)])
            steps.append(time.perf_counter() - t)
        total = time.perf_counter() - start
        engine.cache.free(seq)
        return total, steps

    prefill(PROMPT)  # warm up
    rows = {}
    for chunk in sorted({*args.chunks, PROMPT}):
        runs = [prefill(chunk) for _ in range(args.reps)]
        total = statistics.median(r[0] for r in runs)
        first_step = statistics.median(r[1][0] for r in runs)
        longest_step = statistics.median(max(r[1]) for r in runs)
        rows[chunk] = (total, first_step, longest_step)
    whole = rows[PROMPT][0]
    lines = [
        "# Prefill step size: throughput against the wait it imposes",
        "",
        f"{datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z} on {platform.node()} ({platform.processor() or platform.machine()}), "
        f"default model, {dtype}, one process, torch threads {torch.get_num_threads()}, median of {args.reps}.",
        "",
        f"Command: `.venv/bin/python {' '.join(sys.argv)}`",
        "",
        f"| step (tokens) | {PROMPT}-token prompt, s | tokens/s | vs one step | first step, ms | longest step, ms (a newcomer's wait) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for chunk, (total, first, longest) in rows.items():
        lines.append(f"| {chunk} | {total:.3f} | {PROMPT / total:.0f} | {total / whole:.2f}x | {first * 1e3:.0f} | {longest * 1e3:.0f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
