"""The native prefill-attention kernel alone, this tree's source against another
revision's, side by side in one process, on the default model's attention shapes
(9 query heads sharing 3 kv heads of 64, bfloat16, 16-token pool blocks).

    .venv/bin/python bench/prefill_kernel.py --baseline REV [--reps 7] [--threads 1,2] [--out FILE]

Both sources are compiled with the flags of libs/engine/model/native.py; each row
alternates the two kernels call by call (best of --reps), on the same random q and
pool, and checks that their outputs agree to bfloat16 rounding. GFLOP/s counts the
causal attention's multiply-adds (q k^T and p v, 4 x heads x head_dim per query-key
pair, only the pairs a causal mask keeps). Rows: a whole 2,048-token prompt in one
call, the worker's 256-token steps at the start and at the end of a 2,048-token
prompt, and the last 256-token step of an 8,192-token one. Threads run as OpenMP's
OMP_NUM_THREADS, one child process per thread count.
"""

import argparse
import ctypes
import datetime
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

KERNELS = ROOT / "libs/engine/model/kernels"
ROWS = [(2048, 2048), (256, 256), (256, 2048), (256, 8192)]  # (new tokens, context)
Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def compile_kernel(source_dir: Path, out: Path):
    from libs.engine.model.attention import prefill_kernel_signature
    from libs.engine.model.native import FLAGS

    subprocess.run(["cc", *FLAGS, f"-I{source_dir}", "-o", str(out), str(source_dir / "prefill_attention.c"), "-lm"],
                   check=True)  # fmt: skip
    return prefill_kernel_signature(ctypes.CDLL(str(out)).paged_prefill_attention)


def sources_of(rev: str, into: Path) -> Path:
    """The kernels folder (the kernel and the headers it includes) as it was at ``rev``."""
    into.mkdir(parents=True)
    listing = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{rev}:libs/engine/model/kernels"],
                             check=True, capture_output=True, text=True).stdout.split()  # fmt: skip
    for name in listing:
        if name.endswith((".c", ".h")):
            blob = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:libs/engine/model/kernels/{name}"],
                                  check=True, capture_output=True).stdout  # fmt: skip
            (into / name).write_bytes(blob)
    return into


def child(baseline_dir: Path, reps: int) -> None:
    """Time both kernels on every row, in this process (OMP_NUM_THREADS set by the parent)."""
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        kernels = {"baseline": compile_kernel(baseline_dir, Path(tmp) / "baseline.so"),
                   "this tree": compile_kernel(KERNELS, Path(tmp) / "current.so")}  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    for n, ctx in ROWS:
        blocks = -(-ctx // BLOCK)
        pool = (torch.randn(blocks, 1, 2, BLOCK, KV_HEADS, HEAD_DIM, generator=gen) * 2).to(torch.bfloat16)
        table = torch.randperm(blocks, generator=gen)
        q = (torch.randn(n, Q_HEADS * HEAD_DIM, generator=gen) * 2).to(torch.bfloat16)
        outs = {name: torch.empty(n, Q_HEADS, HEAD_DIM, dtype=torch.bfloat16) for name in kernels}
        best = {name: float("inf") for name in kernels}
        for _ in range(reps):
            for name, fn in kernels.items():
                start = time.perf_counter()
                status = fn(q.data_ptr(), q.stride(0), pool.data_ptr(), table.data_ptr(), n, ctx, outs[name].data_ptr(),
                            Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK, 1, 0, HEAD_DIM**-0.5)  # fmt: skip
                best[name] = min(best[name], time.perf_counter() - start)
                if status != 0:
                    raise SystemExit(f"the {name} kernel declined ({status}): built without AVX512-BF16?")
        a, b = (outs[name].float() for name in kernels)
        agree = torch.allclose(a, b, rtol=1.6e-2, atol=1.6e-2)
        pairs = sum(ctx - n + i + 1 for i in range(n))
        flops = 4 * Q_HEADS * HEAD_DIM * pairs
        old, new = best["baseline"], best["this tree"]
        print(f"| {n} | {ctx} | {os.environ.get('OMP_NUM_THREADS', '?')} | {old * 1e3:.2f} | {new * 1e3:.2f} | "
              f"{flops / old / 1e9:.0f} | {flops / new / 1e9:.0f} | {old / new:.2f}x | {'yes' if agree else 'NO'} |",
              flush=True)  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="the git revision whose kernel to compare with")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--out", type=Path, help="append the report to this file")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.reps)
        return 0
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.baseline], check=True,
                         capture_output=True, text=True).stdout.strip()  # fmt: skip
    lines = [
        "",
        f"### The prefill kernel alone, against {rev} ({datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC)",
        "",
        f"- command: `python bench/prefill_kernel.py {' '.join(sys.argv[1:])}`",
        f"- {Q_HEADS} query heads on {KV_HEADS} kv heads of {HEAD_DIM}, bfloat16, best of {args.reps} calls each,"
        " the two kernels alternating",
        "",
        f"| new tokens | context | threads | {rev} ms | this tree ms | {rev} GFLOP/s | this tree GFLOP/s | speed-up "
        "| outputs agree |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        baseline = sources_of(args.baseline, Path(tmp) / "kernels")
        for threads in args.threads.split(","):
            env = dict(os.environ, OMP_NUM_THREADS=threads)
            run = subprocess.run([sys.executable, __file__, "--baseline", args.baseline, "--reps", str(args.reps),
                                  "--child", str(baseline)], env=env, capture_output=True, text=True)  # fmt: skip
            if run.returncode != 0:
                print(run.stderr[-2000:], file=sys.stderr)
                return run.returncode
            print(run.stdout, end="", flush=True)
            lines += run.stdout.splitlines()
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
