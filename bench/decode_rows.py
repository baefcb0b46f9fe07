"""Decode at small batches on one thread, as `kvserve up` runs a decode worker on 2 cores:
this tree against another checkout (``--baseline PATH``, a `git worktree` of an earlier
commit), alternating, each run in a fresh process pinned to one core.

    .venv/bin/python bench/decode_rows.py --baseline ../kvserve-before --reps 3

A decode step of 2-8 sequences multiplies each projection by the same weight for every
row; the step's time against batch 1's says how much of the weight's reading the rows
share. Tokens/s counts every sequence's tokens (32 after the first, greedy)."""

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BATCHES = (1, 2, 4, 8)


def worker(batches: list[int]) -> None:
    """In the checkout that is the working directory: its own `bench/engine.py` decode
    rows (what `kvserve up` serves), on one thread, as BENCH lines."""
    sys.path.insert(0, os.getcwd())
    import torch

    from bench.engine import DEFAULT_VARIANT, kvserve_worker

    torch.set_num_threads(1)
    kvserve_worker(DEFAULT_VARIANT, 1, batches=tuple(batches), prefill_lengths=())


def kernel_table(threads: int = 1, reps: int = 20) -> str:
    """The int8 LM head's shape alone on ``threads`` threads: torch's kernel,
    ``kernels/int8_rows.c`` (one thread, bfloat16 results), its float32 logits
    (``int8_rows_f32``, on the threads) and the dense bfloat16 weight, per number of rows (ms,
    median of ``reps`` calls)."""
    sys.path.insert(0, str(ROOT))
    import torch

    from libs.engine.model import quant

    torch.set_num_threads(threads)
    kernel, logits = quant._int8_rows_kernel(), quant._int8_rows_kernel(f32=True)
    if kernel is None:
        raise SystemExit("no native int8 kernel here (no C compiler, or KVSERVE_NATIVE_KERNELS=0)")
    torch.manual_seed(0)
    n, k = 49152, 576  # the default model's LM head
    weight = quant.quantize_int8(torch.randn(n, k))
    weight_q, scale = weight.q.contiguous(), weight.scale.to(torch.bfloat16)
    dense = weight_q.to(torch.bfloat16) * scale[:, None]

    def ms(fn) -> float:
        fn()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return 1000 * statistics.median(times)

    lines = [f"torch on {threads} thread(s)", "",
             "| rows | torch's kernel ms | int8_rows ms (one thread) | int8_rows_f32 ms (logits) | dense bfloat16 ms |",
             "|---:|---:|---:|---:|---:|"]  # fmt: skip
    for m in BATCHES:
        x = torch.randn(m, k).to(torch.bfloat16)
        y = torch.empty(m, n, dtype=torch.bfloat16)
        y32 = torch.empty(m, n, dtype=torch.float32)
        timings = (ms(lambda: quant._INT8_MM(x, weight_q, scale)),
                   ms(lambda: kernel(x.data_ptr(), weight_q.data_ptr(), scale.data_ptr(), y.data_ptr(), m, n, k)),
                   ms(lambda: logits(x.data_ptr(), weight_q.data_ptr(), scale.data_ptr(), y32.data_ptr(), m, n, k,
                                     threads)),
                   ms(lambda: torch.nn.functional.linear(x, dense)))  # fmt: skip
        lines.append(f"| {m} | " + " | ".join(f"{t:.2f}" for t in timings) + " |")
    return "\n".join(lines) + "\n"


def measure(tree: Path, core: int, batches: list[int]) -> dict[int, float]:
    result = subprocess.run(
        ["taskset", "-c", str(core), sys.executable, str(Path(__file__).resolve()), "--worker",
         "--batches", *map(str, batches)],
        cwd=tree, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    rows = [json.loads(line[6:]) for line in result.stdout.splitlines() if line.startswith("BENCH ")]
    decode = {row["decode"]: row["tok_s"] for row in rows if "decode" in row}
    if set(decode) != set(batches):
        raise SystemExit(f"{tree}: no result\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    return decode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, help="another kvserve checkout, measured alternately")
    parser.add_argument("--reps", type=int, default=3, help="runs of each tree (default 3)")
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--core", type=int, default=len(os.sched_getaffinity(0)) - 1, help="core to pin to")
    parser.add_argument("--out", type=Path, help="write the markdown table here too")
    parser.add_argument("--kernel", action="store_true",
                        help="only the LM head's multiply alone, per number of rows (run it under taskset -c N)")
    parser.add_argument("--threads", type=int, default=1, help="with --kernel: torch's threads (default 1)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.batches)
    if args.kernel:
        return print(kernel_table(args.threads))
    trees = {"this tree": ROOT} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    runs: dict[str, list[dict[int, float]]] = {name: [] for name in trees}
    began = datetime.datetime.now(datetime.timezone.utc)
    for rep in range(args.reps):
        for name, tree in trees.items():
            runs[name].append(measure(tree, args.core, args.batches))
            print(f"run {rep + 1} {name}: " + ", ".join(f"b={b} {v:.1f}" for b, v in runs[name][-1].items()))
    median = {name: {b: statistics.median(r[b] for r in rs) for b in args.batches} for name, rs in runs.items()}
    head = "| batch | " + " | ".join(f"{name} tokens/s" for name in trees)
    lines = [head + (" | this tree / baseline |" if args.baseline else " |"),
             "|---:|" + "---:|" * (len(trees) + bool(args.baseline))]
    for b in args.batches:
        cells = [f"{median[name][b]:.1f}" for name in trees]
        if args.baseline:
            cells.append(f"{median['this tree'][b] / median['baseline'][b]:.2f}x")
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    command = "python bench/decode_rows.py " + " ".join(sys.argv[1:])
    text = (f"- command: `{command}`\n- date: {began:%Y-%m-%d %H:%M} UTC; core {args.core}, one thread; "
            f"median of {args.reps} alternated runs" + (f"; baseline {args.baseline}" if args.baseline else "") +
            "\n\n" + "\n".join(lines) + "\n")  # fmt: skip
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
