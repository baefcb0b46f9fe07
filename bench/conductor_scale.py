"""One simulation of the full trace at a given cluster size, timed, as one JSON line:
the simulator's wall and CPU time, the CPU time of each `Admitter.admit` (p50, p99,
max, total), the cache hit rate by the tier the reused tokens came from, and a
fingerprint of every routing decision (equal between two checkouts that route alike),
and the garbage collector's full (generation-2) passes during the run: how many, the
longest. As the live conductor freezes its start-up heap (libs/common/heap.py), the
simulation is built and then frozen before it runs; ``--no-freeze`` leaves it unfrozen.

    .venv/bin/python bench/conductor_scale.py --prefill 1024 --decode 1024 [--store-blocks 0] [--code DIR] [--no-freeze]

``--code DIR`` imports the conductor from another checkout (a baseline to compare
with); `bench/conductor.py --sections scale` runs this for each size and checkout.

``--repeat N`` runs the same simulation N times (the same decisions each time: it is
deterministic) and also reports the admission CPU percentiles of each admission's least
time over the runs (``admit_min_*``). The CPU time a thread is charged for on a shared
virtual machine includes what the host takes from it (steal, cache contention). In two
runs here, only 25 of the 120 slowest admissions were the same requests, so a single
run's tail is mostly the machine's. The least of N times is the admission's own cost.
"""

import argparse
import gc
import hashlib
import json
import sys
import time
from pathlib import Path


def digest(requests) -> str:
    """A fingerprint of every routing decision (prefill, decode, copy source, refusal), in order:
    equal between two runs only if each request went to the same instances."""
    h = hashlib.sha256()
    for r in requests:
        d = r.decision
        h.update(f"{d.prefill_id}|{d.decode_id}|{d.copy_from}|{d.error_code};".encode())
    return h.hexdigest()[:12]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    root = Path(__file__).resolve().parent.parent
    parser.add_argument("--trace", type=Path, default=root.parent / "shared" / "traces" / "conversation_trace.jsonl")
    parser.add_argument("--prefill", type=int, required=True)
    parser.add_argument("--decode", type=int, required=True)
    parser.add_argument("--policy", default="cache_aware")
    parser.add_argument("--store-blocks", type=int, default=50_000)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--code", type=Path, default=root, help="the checkout whose conductor runs (default: this one)")
    parser.add_argument("--no-freeze", action="store_true", help="leave the built simulation in the GC's passes")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run it this many times and also report each admission's least CPU time (default 1)")
    args = parser.parse_args()
    sys.path.insert(0, str(args.code.resolve()))

    import numpy as np

    from services.conductor.simulator.report import summarize
    from services.conductor.simulator.simulation import SimConfig, Simulation
    from services.conductor.simulator.trace import load_trace

    trace = load_trace(args.trace, args.time_scale)

    def run_once():
        sim = Simulation(SimConfig(args.prefill, args.decode, args.policy, store_blocks=args.store_blocks), trace)
        admit, cpu_ns = sim.scheduler.admit, []

        def timed_admit(request):
            started = time.thread_time_ns()
            decision = admit(request)
            cpu_ns.append(time.thread_time_ns() - started)
            return decision

        sim.scheduler.admit = timed_admit
        if not args.no_freeze:
            gc.collect()
            gc.freeze()
        full_ms: list[float] = []  # how long each generation-2 pass took
        started = 0.0

        def on_gc(phase: str, info: dict) -> None:
            nonlocal started
            if info["generation"] != 2:
                return
            if phase == "start":
                started = time.perf_counter()
            else:
                full_ms.append((time.perf_counter() - started) * 1e3)

        gc.callbacks.append(on_gc)
        wall, cpu = time.perf_counter(), time.process_time()
        result = sim.run()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        gc.callbacks.remove(on_gc)
        if not args.no_freeze:
            gc.unfreeze()
        return result, np.array(cpu_ns) / 1e3, wall, cpu, full_ms

    runs = [run_once() for _ in range(max(1, args.repeat))]
    result, us, wall, cpu, full_ms = runs[0]
    if len({digest(r[0].requests) for r in runs}) != 1:
        raise SystemExit("the runs took different decisions: the simulation is not deterministic")
    least = np.min(np.stack([r[1] for r in runs]), axis=0)
    summary = summarize(result)
    print(json.dumps({
        "prefill": args.prefill, "decode": args.decode, "policy": args.policy, "store_blocks": args.store_blocks,
        "requests": len(trace), "wall_s": wall, "cpu_s": cpu, "admit_cpu_s": float(us.sum() / 1e6),
        "admit_p50_us": float(np.percentile(us, 50)), "admit_p99_us": float(np.percentile(us, 99)),
        "admit_max_us": float(us.max()), "hit": summary.cache_hit_rate, "hit_by_tier": summary.hit_by_tier,
        "slo_attainment": summary.slo_attainment, "ttft_p99_s": summary.ttft_p99, "decisions": digest(result.requests),
        "frozen": not args.no_freeze, "gc_full_passes": len(full_ms), "gc_full_max_ms": max(full_ms, default=0.0),
        "repeat": len(runs), "admit_p99_us_each": [float(np.percentile(r[1], 99)) for r in runs],
        "admit_min_p50_us": float(np.percentile(least, 50)), "admit_min_p99_us": float(np.percentile(least, 99)),
        "admit_min_max_us": float(least.max()),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
