"""The noisy neighbour in the simulator (`services/conductor/simulator/scenarios.py`):
one prefill and one decode instance at the reference cost model, 2,048-token prompts,
tenant ``a`` at ``--flood`` times the cluster's capacity and ``b`` at ``--light`` times it,
Poisson arrivals. Side by side on the same requests: b alone; both with the default
rules; the other tenants' short chunks off (``prefill_contended_tokens=0``); and no
tenants at all (one shared queue). Deterministic for a seed.

    .venv/bin/python bench/tenants_sim.py --out bench/results/tenants-sim.md
"""

import argparse
import datetime
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from libs.engine.cost_model import CostModel, reference_coefficients  # noqa: E402
from services.conductor.simulator.report import meets_slo  # noqa: E402
from services.conductor.simulator.scenarios import noisy_neighbour  # noqa: E402
from services.conductor.simulator.simulation import SimConfig, simulate  # noqa: E402

POLICY = "cache_aware+predictive_rejection"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flood", type=float, default=4.0, help="a's rate, a multiple of the capacity (default 4)")
    ap.add_argument("--light", type=float, default=0.25, help="b's rate, a multiple of the capacity (default 0.25)")
    ap.add_argument("--seconds", type=float, default=60.0, help="the trace's length (default 60)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="write the report here (default: print it)")
    args = ap.parse_args()
    capacity = 1 / CostModel(reference_coefficients()).prefill_time(2048, 0)  # requests a second, one prefill
    trace = noisy_neighbour(capacity, args.flood, args.light, args.seconds, seed=args.seed)
    base = SimConfig(1, 1, POLICY, seed=args.seed)
    runs = {
        "b alone": (base, [t for t in trace if t.tenant == "b"]),
        "a and b (default)": (base, trace),
        "a and b, short chunks off": (replace(base, prefill_contended_tokens=0), trace),
        "a and b, no tenants": (base, [replace(t, tenant=None) for t in trace]),
    }
    tenant_of = {t.index: t.tenant for t in trace}
    lines = [
        "# The noisy neighbour in the simulator",
        "",
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC. One prefill and one decode instance, "
        f"reference cost model ({capacity:.2f} req/s of 2,048-token prompts), `{POLICY}`, a at {args.flood:g}x "
        f"and b at {args.light:g}x that for {args.seconds:g} s, seed {args.seed}; SLO TTFT {base.slo.ttft_s:g} s, "
        f"TPOT {base.slo.tbt_s * 1e3:.0f} ms.",
        "",
        f"Command: `.venv/bin/python bench/tenants_sim.py {' '.join(sys.argv[1:])}`",
        "",
        "| run | tenant | requests | SLO attained | refused | TTFT p50 / p99 s |",
        "|---|---|---:|---:|---:|---|",
    ]
    for name, (config, requests) in runs.items():
        result = simulate(config, requests)
        for tenant in ("a", "b"):
            mine = [r for r in result.requests if tenant_of[r.trace.index] == tenant]
            if not mine:
                continue
            ttft = [r.ttft for r in mine if r.ttft is not None]
            met = sum(meets_slo(r, config.slo) for r in mine)
            refused = sum(r.outcome == "rejected" for r in mine)
            pct = (f"{np.percentile(ttft, 50):.2f} / {np.percentile(ttft, 99):.2f}" if ttft else "–")
            lines.append(f"| {name} | {tenant} | {len(mine)} | {met / len(mine):.1%} | {refused} | {pct} |")
    text = "\n".join(lines) + "\n"
    if args.out is not None:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
