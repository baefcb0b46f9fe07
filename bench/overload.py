"""The overload guard's trade-off, in the simulator: how much goodput preferring short
prompts buys, and what it costs the long ones, for each KVSERVE_MAX_BAND_REFUSAL_RATIO.

The shared conversation trace's first requests, their lengths scaled as `kvserve bench
--block-tokens 8 --max-input 0` sends them (8 tokens per 512-token hash id: half the
prompts under ~110 tokens, a tail to ~2,000), on one prefill and one decode instance
whose cost model is a 2-core CPU's (the default model's calibration here), at several
loads. Per setting and load: goodput, SLO attainment, and attainment and refusals per
prompt-size band. Deterministic for a seed.

    .venv/bin/python bench/overload.py --out bench/results/overload.md
"""

import argparse
import datetime
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from libs.common.prefill_order import BAND_NAMES, band_of  # noqa: E402
from libs.protocol.schema import CostCoefficients  # noqa: E402
from services.conductor.settings import DEFAULT_POLICY  # noqa: E402
from services.conductor.simulator.simulation import SimConfig, simulate  # noqa: E402
from services.conductor.simulator.trace import TraceRequest, load_trace  # noqa: E402

TRACE = ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl"
# one worker's calibration of the default model (bfloat16, int4, one core each), per 512-token
# block where the simulator counts blocks
CPU = CostCoefficients(block_size=512, prefill_base=0.0429, prefill_per_token=0.00132, prefill_per_token_context=1.31e-6,
                       decode_base=0.00655, decode_per_seq=0.0042, decode_per_context_token=7.06e-6,
                       transfer_per_block=32 * 11.7e-6)  # fmt: skip
RATIOS = (0.0, 1.5, 3.0, 10.0)


def scaled(requests: list[TraceRequest], tokens_per_block: int = 8, max_output: int = 16) -> list[TraceRequest]:
    return [TraceRequest(r.index, r.arrival_s, max(1, r.input_length * tokens_per_block // 512),
                         min(r.output_length, max_output), r.hash_ids) for r in requests]  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--requests", type=int, default=1500)
    ap.add_argument("--time-scales", type=float, nargs="+", default=[1.0, 0.5, 0.25])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    lines = [
        "# Overload: preferring short prompts, and the guard that bounds it (simulated)",
        "",
        f"{datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}. Command: `.venv/bin/python {' '.join(sys.argv)}`",
        "",
        f"Trace `{args.trace.name}`, its first {args.requests} requests, lengths scaled to 8 tokens per hash id "
        f"(uncapped), at most 16 output tokens; 1 prefill + 1 decode instance with a 2-core CPU's cost model, no "
        f"store, policy `{DEFAULT_POLICY}`, SLO TTFT 2 s / TBT 150 ms, noise 10%. "
        "`ratio` is `KVSERVE_MAX_BAND_REFUSAL_RATIO` (0: no preference for short prompts).",
        "",
        "| time scale | ratio | goodput req/s | SLO attained | admitted in SLO | "
        + " | ".join(f"{b} attained / refused" for b in BAND_NAMES) + " |",
        "|---:|---:|---:|---:|---:|" + "---:|" * len(BAND_NAMES),
    ]
    base = scaled(load_trace(args.trace, time_scale=1.0, max_requests=args.requests))
    for scale in args.time_scales:
        trace = [TraceRequest(r.index, r.arrival_s * scale, r.input_length, r.output_length, r.hash_ids) for r in base]
        for ratio in RATIOS:
            config = SimConfig(1, 1, DEFAULT_POLICY, coefficients=CPU, store_blocks=0, max_band_refusal_ratio=ratio)
            result = simulate(config, trace)
            slo = config.slo
            good = [r for r in result.requests if r.outcome == "done" and r.ttft is not None and r.ttft <= slo.ttft_s
                    and (r.tbt is None or r.tbt <= slo.tbt_s)]  # fmt: skip
            admitted = [r for r in result.requests if r.outcome != "rejected"]
            kept = sum(1 for r in good) / len(admitted) if admitted else 0.0
            cells = []
            for band in range(len(BAND_NAMES)):
                members = [r for r in result.requests if band_of(r.trace.input_length) == band]
                if not members:
                    cells.append("–")
                    continue
                ok = sum(1 for r in good if band_of(r.trace.input_length) == band)
                refused = sum(1 for r in members if r.outcome == "rejected")
                cells.append(f"{ok / len(members):.1%} / {refused / len(members):.1%}")
            span = max(r.trace.arrival_s for r in result.requests) or 1.0
            lines.append(f"| {scale:g} | {ratio:g} | {len(good) / span:.3f} | {len(good) / len(result.requests):.1%} "
                         f"| {kept:.1%} | " + " | ".join(cells) + " |")  # fmt: skip
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
