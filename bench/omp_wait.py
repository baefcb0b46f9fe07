"""How a worker's OpenMP threads should wait: the decode step against the cost to others.

A worker with two or more torch threads hands each matmul to its OpenMP team; between
two matmuls of a step the team waits a few microseconds, between requests far longer.
Three ways to wait, side by side in one run, each in its own process:

- ``default``: libgomp's own (spin ~300,000 times, then sleep);
- ``passive``: ``OMP_WAIT_POLICY=PASSIVE`` (sleep at once: every matmul wakes its team);
- ``spin-1000``: ``GOMP_SPINCOUNT=1000`` (spin briefly, then sleep).

Two measurements for each:

- the batch-1 decode step of the default model with 2 threads (ms, median of 5 runs of
  64 tokens): what a worker's TPOT pays;
- contention: 300 small matmuls (2 threads), each followed by a 2 ms pause, while two
  busy processes run on the same cores (wall seconds): what a waiting team costs a
  neighbour that needs those cores, as an idle-ish worker beside a busy one.

    python bench/omp_wait.py [--out bench/results/omp_wait.md]
"""

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
POLICIES = {"default": {}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"}, "spin-1000": {"GOMP_SPINCOUNT": "1000"}}


def decode_step_ms() -> float:
    sys.path.insert(0, str(ROOT))
    import torch

    from libs.engine.model.engine import EngineConfig
    from libs.engine.model.generator import Generator
    from libs.engine.model.loader import build_engine, load_model
    from libs.protocol.sampling_params import SamplingParams

    torch.set_num_threads(2)
    torch.set_grad_enabled(False)
    loaded = load_model(None, progress=False)
    engine = build_engine(loaded, EngineConfig(num_blocks=256, enable_prefix_cache=False))
    runs = []
    for _ in range(5):
        generator = Generator(engine, loaded.tokenizer, max_batch_size=1)
        generator.add_request(list(range(100, 300)), SamplingParams(max_tokens=65, temperature=0, ignore_eos=True))
        generator.step()
        start, steps = time.perf_counter(), 0
        while generator.has_work:
            generator.step()
            steps += 1
        runs.append((time.perf_counter() - start) / steps * 1e3)
    return statistics.median(runs)


def contention_s() -> float:
    import torch

    torch.set_num_threads(2)
    x = torch.randn(256, 256)
    for _ in range(10):
        x @ x
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        time.sleep(0.5)  # let them take the cores
        start = time.perf_counter()
        for _ in range(300):
            x @ x
            time.sleep(0.002)
        return time.perf_counter() - start
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()


def measure(policy: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(POLICIES[policy])
    out = subprocess.run([sys.executable, __file__, "--worker"], env=env, cwd=ROOT, capture_output=True, text=True,
                         check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "omp_wait.md")
    parser.add_argument("--rounds", type=int, default=2, help="each policy measured this many times, interleaved")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps({"step_ms": decode_step_ms(), "contention_s": contention_s()}), flush=True)
        return
    results: dict[str, list[dict]] = {policy: [] for policy in POLICIES}
    for _ in range(args.rounds):
        for policy in POLICIES:
            results[policy].append(measure(policy))
            print(policy, results[policy][-1], flush=True)
    lines = [
        "# OpenMP wait policy: a worker's decode step against its neighbours",
        "",
        f"- command: `python bench/omp_wait.py --rounds {args.rounds}`",
        f"- date: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}",
        f"- machine: {os.cpu_count()} cores; torch's libgomp; each policy in its own process, rounds interleaved",
        "",
        "| policy | environment | batch-1 decode step, 2 threads (ms) | 300 matmuls + 2 ms pauses beside two busy "
        "processes (s) |",
        "|---|---|---|---|",
    ]
    for policy, runs in results.items():
        env = " ".join(f"{k}={v}" for k, v in POLICIES[policy].items()) or "(none)"
        steps = ", ".join(f"{r['step_ms']:.2f}" for r in runs)
        waits = ", ".join(f"{r['contention_s']:.2f}" for r in runs)
        lines.append(f"| {policy} | `{env}` | {steps} | {waits} |")
    args.out.write_text("\n".join(lines) + "\n")
    print(args.out.read_text())


if __name__ == "__main__":
    main()
