"""What bounding oneDNN's matmul caches costs (libs/engine/primitive_caches.py): the
default model prefills 150 prompts of random lengths 9-256 (every one a step of its
own token count, most counts new), in a fresh process with the caches bounded as a
worker bounds them and in one with oneDNN's defaults (1,024 entries each), alternating.

    .venv/bin/python bench/primitive_caches.py [--rounds 2]

Prints each run's seconds (the best of two passes over the prompts, after one to warm
up) and the resident memory the process ended with.
"""

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

RUN = """
import os, random, sys, time, torch
sys.path.insert(0, {root!r})
from libs.engine.model import steps
from libs.engine.model.engine import EngineConfig
from libs.engine.model.loader import build_engine, load_model
from libs.engine.model.sequence import Sequence

model = load_model(None, dtype="bfloat16", progress=False)
engine = build_engine(model, EngineConfig(num_blocks=256, enable_prefix_cache=False))
rng = random.Random(0)
lengths = [rng.randrange(9, 257) for _ in range(150)]

def run():
    start = time.perf_counter()
    for i, n in enumerate(lengths):
        seq = Sequence.from_prompt(str(i), [rng.randrange(100, 40000) for _ in range(n)])
        steps.prefill(engine, [seq])
        engine.cache.free(seq)
    return time.perf_counter() - start

run()
seconds = min(run() for _ in range(2))
rss = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS:")) / 1024
print(seconds, rss)
"""


def measure(bounded: bool) -> tuple[float, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    code = RUN.format(root=str(ROOT))
    if bounded:  # as a worker does, before its first matmul (after sys.path names the tree)
        bound = "from libs.engine.primitive_caches import bound_primitive_caches; bound_primitive_caches()\n"
        code = code.replace("from libs.engine.model import steps", bound + "from libs.engine.model import steps")
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True).stdout
    seconds, rss = map(float, out.split()[-2:])
    return seconds, rss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for r in range(args.rounds):
        for bounded in (True, False) if r % 2 == 0 else (False, True):
            runs[bounded].append(measure(bounded))
            print(f"{'bounded' if bounded else 'default'}: {runs[bounded][-1][0]:.2f} s, "
                  f"RSS {runs[bounded][-1][1]:.0f} MB", flush=True)  # fmt: skip
    for bounded in (True, False):
        print(f"{'bounded (64 entries)' if bounded else 'oneDNN default (1,024)'}: median "
              f"{statistics.median(s for s, _ in runs[bounded]):.2f} s, RSS "
              f"{statistics.median(m for _, m in runs[bounded]):.0f} MB")  # fmt: skip


if __name__ == "__main__":
    main()
