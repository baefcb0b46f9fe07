"""``kvserve simulate``: replay a Mooncake-format trace through the conductor's
own policies against a simulated cluster; print the table, write the plot.

The command line and the output only; the simulation is
services/conductor/simulator's.
"""

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import msgspec

from kvserve.cli.options import positive_int
from libs.protocol.schema import CostCoefficients
from libs.protocol.slo import DEFAULT_TBT_S, DEFAULT_TTFT_S

DESCRIPTION = """\
Replay a Mooncake-format trace (one JSON request per line: timestamp in ms,
input_length, output_length, hash_ids of 512-token blocks) through the live
conductor's scheduler, policies, KV index and cost model, against simulated
prefill, decode and store instances whose timings come from a cost model
(by default a GPU-class reference profile). Deterministic for a seed. Prints
TTFT and TBT percentiles, SLO attainment, goodput, rejections, wasted
prefills and the cache hit rate per policy, and writes DIR/simulate.png and
DIR/summary.json."""

EPILOG = """\
policies: random, least_loaded, cache_aware, then options joined with '+':
  replication, early_rejection, predictive_rejection, local_prefill
examples:
  kvserve simulate --trace ../shared/traces/conversation_trace.jsonl --prefill 16 --decode 16 \\
      --policy random,least_loaded,cache_aware
  kvserve simulate --trace T.jsonl --prefill 8 --decode 2 --time-scale 0.5 \\
      --policy cache_aware+early_rejection,cache_aware+predictive_rejection
  kvserve simulate --trace T.jsonl --prefill 4 --decode 4 --cost-model calibrate   (this machine's model)"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "simulate", help="replay a trace through the conductor's policies on a simulated cluster",
        description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--trace", required=True, type=Path, help="Mooncake-format JSONL trace")
    parser.add_argument("--prefill", type=positive_int, required=True, metavar="N", help="prefill instances")
    parser.add_argument("--decode", type=positive_int, required=True, metavar="M", help="decode instances")
    parser.add_argument("--policy", default="cache_aware", metavar="P[,P...]",
                        help="one policy or a comma-separated list to compare (default cache_aware)")  # fmt: skip
    parser.add_argument("--time-scale", type=float, default=1.0, metavar="X",
                        help="multiply arrival times by X: below 1 the same requests come faster (default 1)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="random policy and duration noise (default 0)")
    parser.add_argument("--max-requests", type=positive_int, default=None, metavar="K", help="only the first K requests")
    parser.add_argument("--start", type=int, default=0, metavar="I", help="skip the first I requests (default 0)")
    parser.add_argument("--out", type=Path, default=Path("simulate-out"), metavar="DIR",
                        help="where the plot and summary go (default ./simulate-out)")  # fmt: skip
    parser.add_argument("--slo-ttft-ms", type=float, default=DEFAULT_TTFT_S * 1e3, help="TTFT SLO (default %(default)g)")
    parser.add_argument("--slo-tbt-ms", type=float, default=DEFAULT_TBT_S * 1e3, help="TBT SLO (default %(default)g)")
    parser.add_argument("--cost-model", default="reference", metavar="reference|calibrate|FILE",
                        help="reference (a GPU-class profile, the default), calibrate (time the default model "
                             "on this machine), or a JSON file of CostCoefficients")  # fmt: skip
    parser.add_argument("--prefill-cache-blocks", type=int, default=2000, help="blocks each prefill instance caches")
    parser.add_argument("--store-blocks", type=int, default=50_000, help="blocks the store's DRAM tier holds (0: no store)")
    parser.add_argument("--decode-kv-tokens", type=int, default=1_500_000, help="KV tokens a decode instance holds")
    parser.add_argument("--noise", type=float, default=0.1, help="lognormal sigma on actual durations (default 0.1)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from libs.protocol.slo import SLO
    from services.conductor.simulator.report import plot, summarize, table
    from services.conductor.simulator.simulation import SimConfig, simulate
    from services.conductor.simulator.trace import load_trace

    if not args.trace.is_file():
        print(f"kvserve simulate: no trace at {args.trace}", file=sys.stderr)
        return 2
    trace = load_trace(args.trace, args.time_scale, args.max_requests, args.start)
    coefficients = _coefficients(args.cost_model)
    results, summaries = [], []
    for policy in [p.strip() for p in args.policy.split(",") if p.strip()]:
        try:
            config = SimConfig(
                args.prefill, args.decode, policy, seed=args.seed, slo=SLO.from_ms(args.slo_ttft_ms, args.slo_tbt_ms),
                coefficients=coefficients, prefill_cache_blocks=args.prefill_cache_blocks,
                store_blocks=args.store_blocks, decode_kv_tokens=args.decode_kv_tokens, noise=args.noise,
            )  # fmt: skip
        except ValueError as e:
            print(f"kvserve simulate: {e}", file=sys.stderr)
            return 2
        started = time.perf_counter()
        result = simulate(config, trace)
        wall = time.perf_counter() - started
        results.append(result)
        summaries.append(summarize(result))
        print(f"{policy}: {len(trace)} requests, {result.duration_s:.0f} s simulated in {wall:.1f} s", file=sys.stderr)
    print(f"{len(trace)} requests of {args.trace.name} (time scale {args.time_scale:g}), "
          f"{args.prefill} prefill + {args.decode} decode, SLO TTFT {args.slo_ttft_ms:g} ms / TBT {args.slo_tbt_ms:g} ms, "
          f"seed {args.seed}")  # fmt: skip
    print(table(summaries))
    args.out.mkdir(parents=True, exist_ok=True)
    png = plot(results, args.out / "simulate.png")
    (args.out / "summary.json").write_text(json.dumps([asdict(s) for s in summaries], indent=2))
    print(f"plot: {png}; summary: {args.out / 'summary.json'}")
    return 0


def _coefficients(spec: str) -> CostCoefficients:
    from libs.engine.cost_model import reference_coefficients
    from services.conductor.simulator.trace import TRACE_BLOCK_SIZE

    if spec == "reference":
        return reference_coefficients(TRACE_BLOCK_SIZE)
    if spec == "calibrate":
        coefficients = _calibrate_here()
    else:
        coefficients = msgspec.json.decode(Path(spec).read_bytes(), type=CostCoefficients)
    # per-token terms hold at any block size; per-block terms scale with it
    scale = TRACE_BLOCK_SIZE / coefficients.block_size
    return msgspec.structs.replace(coefficients, block_size=TRACE_BLOCK_SIZE, transfer_per_block=coefficients.transfer_per_block * scale,
                   load_per_block={t: s * scale for t, s in coefficients.load_per_block.items()})  # fmt: skip


def _calibrate_here() -> CostCoefficients:
    from libs.engine.cost_model import CostModel, calibrate
    from libs.engine.model.engine import EngineConfig
    from libs.engine.model.loader import build_engine, load_model

    loaded = load_model(None, progress=True)
    engine = build_engine(loaded, EngineConfig(num_blocks=256))
    coefficients = calibrate(engine)
    print(f"calibrated on this machine: {CostModel(coefficients).describe()}", file=sys.stderr)
    return coefficients
