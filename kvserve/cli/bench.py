"""``kvserve bench``: replay a Mooncake-format trace against any OpenAI-compatible
endpoint and report latency percentiles, SLO attainment and goodput.

The command line and the files it names only; the replay is ``kvserve.replay``'s.
"""

import argparse
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvserve.cli.options import count, fraction, positive_float, positive_int
from libs.protocol.errors import KVServeError
from libs.protocol.models import DEFAULT_MODEL_ID
from libs.protocol.slo import DEFAULT_TBT_S, DEFAULT_TTFT_S

if TYPE_CHECKING:  # the replay loads only when the command runs
    from kvserve.replay.client import Endpoint
    from kvserve.replay.sweep import SweepSettings
    from kvserve.replay.trace import TraceRequest

DESCRIPTION = """\
Replay a Mooncake-format trace (JSONL: timestamp ms, input_length, output_length,
hash_ids; 512 tokens per hash id) open-loop against an OpenAI-compatible server:
each request is sent at its timestamp times --time-scale, never waiting for
earlier ones, as a token-id prompt to /v1/completions (streamed, greedy,
ignore_eos, max_tokens = its output length). Equal hash ids become equal blocks
of --block-tokens token ids, so the trace's prefix sharing is reproduced
exactly; the input length is scaled by block-tokens/512, and the last partial
block is the request's own. --max-input caps prompts (0, the default: no cap).

Per request it measures, from the client: TTFT, every inter-token latency, TPOT,
end-to-end latency, cached tokens (usage.prompt_tokens_details.cached_tokens),
and whether it was rejected (HTTP 429, not an error) or failed. It reports
p50/p90/p99, SLO attainment (good requests / requests sent) and goodput (good
requests / second), with vLLM's `bench serve --goodput` definitions: a request
is good when it completed with TTFT <= --slo-ttft-ms and TPOT <= --slo-tbt-ms.
Each run also gives the attainment among admitted requests (good / requests not
refused) and the refusals made while idle: 429s that arrived while no other
request of the run was waiting for its first token (and, in brackets, near idle:
those and the ones whose waiting requests all had it within 0.25 s). A table by prompt size splits
each run by prompt length as sent (<128, 128-511, 512-1023, >=1024 tokens): sent,
completed, refused (and while idle), errors, good, both attainments, TTFT p50/p99.

Several --time-scale values make a load sweep: one run each, in order, with
prompts seeded seed, seed+1, ... so no run hits the previous run's cache.
--out gets a JSON file per run (every request), summary.md, ttft_cdf.png and,
for a sweep, goodput_vs_load.png.

--find-capacity searches for the effective request capacity instead: the
highest offered load (req/s) at which at least --target-attainment of the
requests sent meet both SLOs (rejected ones do not). It probes --start-scale,
halves the time scale while probes pass (doubling it while they fail, up to
--max-scale) until the capacity is bracketed, then bisects the bracket in log
space, --max-probes runs in all, probe i with prompt seed seed+i. It reports the capacity (the offered
rate of the heaviest passing probe), the bracket's width in req/s, the peak
goodput, attainment and goodput per probe, or "no capacity" when no load tried
reached the target, then the prompt-size bands of the peak-goodput and capacity
probes. --out gets a JSON file per probe, capacity.md and
capacity.png (attainment and goodput against offered load).

A window from the start of a trace meets a cold cache; --start I --warm-history
first sends, before each run, the prefixes the window shares with requests
0..I-1 (one prompt each, made of those blocks, with the run's seed), as a server
that had served the trace up to I would hold them."""

EPILOG = """\
examples:
  kvserve bench --trace ../shared/traces/conversation_trace.jsonl \\
      --base-url http://127.0.0.1:8000 --max-requests 200 --max-output 32
  kvserve bench --trace T.jsonl --base-url http://127.0.0.1:8080 --time-scale 1 0.5 0.25 --out bench/out/sweep
  kvserve bench --trace T.jsonl --base-url http://127.0.0.1:8000 --max-requests 100 --spread \\
      --find-capacity --start-scale 4 --max-probes 6 --out bench/out/capacity"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="replay a Mooncake trace against an OpenAI-compatible server: latencies, SLO attainment, goodput",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--base-url", required=True, metavar="URL", help="server root, e.g. http://127.0.0.1:8000 (/v1 optional)")
    p.add_argument("--model", default=DEFAULT_MODEL_ID, metavar="M", help=f"model name sent (default {DEFAULT_MODEL_ID})")
    p.add_argument(
        "--api-key", default=os.environ.get("KVSERVE_API_KEY") or None, metavar="K",
        help="sent as 'Authorization: Bearer K' (default: $KVSERVE_API_KEY, else none)",
    )  # fmt: skip
    p.add_argument(
        "--tokenizer", default=None, metavar="PATH",
        help=f"HF folder or tokenizer.json whose ordinary (non-special) token ids prompts are made of "
        f"(default: {DEFAULT_MODEL_ID}, prepared on first use)",
    )  # fmt: skip
    p.add_argument(
        "--time-scale", type=_non_negative, nargs="+", default=None, metavar="X",
        help="arrival time = trace timestamp x X (default 1; 0.5 is twice the rate); several make a sweep",
    )  # fmt: skip
    p.add_argument(
        "--spread", action="store_true",
        help="spread requests that share a timestamp evenly up to the next timestamp (the released traces "
        "stamp ~10 requests per 3-second bucket; without this they arrive as one burst)",
    )  # fmt: skip
    p.add_argument("--max-requests", type=positive_int, default=None, metavar="N", help="replay N requests (default all)")
    add_workload_options(p, WorkloadDefaults())
    p.add_argument("--label", default=None, help="name of the runs in the reports (default: the base URL)")
    p.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS", help="per-request limit (default 600)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.set_defaults(run=run, usage_error=p.error)


@dataclass(frozen=True)
class WorkloadDefaults:
    """What a tool that takes `add_workload_options` defaults to. A search option left
    None is told apart from one given (``kvserve bench`` refuses them without
    --find-capacity) and means its ``*_shown`` value."""

    trace: Path | None = None  # None: --trace is required
    max_input: str = "0"  # as typed: 0 is no cap
    max_output: int | None = None
    target_attainment: float | None = None
    max_probes: int | None = None
    start_scale: float | None = None
    start_scale_shown: float = 1.0
    out: str = "bench/out/<time>"


TARGET_ATTAINMENT, MAX_PROBES = 0.9, 6  # --find-capacity's defaults


def add_workload_options(p: argparse.ArgumentParser, defaults: WorkloadDefaults) -> None:
    """The options ``kvserve bench`` and bench/replay.py share, one definition each: the
    trace window, how prompts are made from it, the SLOs, the capacity search and where
    results go."""
    trace_help = "Mooncake-format JSONL trace" + (f" (default {defaults.trace})" if defaults.trace else "")
    p.add_argument("--trace", required=defaults.trace is None, default=defaults.trace, type=Path, metavar="FILE",
                   help=trace_help)  # fmt: skip
    p.add_argument("--start", type=count, default=0, metavar="I", help="first trace request (default 0)")
    p.add_argument(
        "--warm-history", action="store_true",
        help="before each run, send (one at a time, one output token each) the prefixes the window shares with "
        "the trace's requests before --start, so the run starts from the cache a server holds after serving the "
        "trace up to there instead of a cold one",
    )  # fmt: skip
    p.add_argument("--block-tokens", type=positive_int, default=16, metavar="T", help="tokens per hash id (default 16)")
    p.add_argument(
        "--max-input", type=input_cap, default=defaults.max_input, metavar="T",
        help=f"cap prompts at T tokens by truncating (keeps the leading hash-id blocks, so sharing is preserved); "
        f"0 is no cap: prompt lengths follow the trace scaled by block-tokens/512 (default {defaults.max_input})",
    )  # fmt: skip
    shown = "none" if defaults.max_output is None else defaults.max_output
    p.add_argument("--max-output", type=positive_int, default=defaults.max_output, metavar="T",
                   help=f"cap max_tokens at T (default {shown})")  # fmt: skip
    p.add_argument("--slo-ttft-ms", type=float, default=DEFAULT_TTFT_S * 1e3, metavar="MS",
                   help="TTFT objective (default %(default)g)")
    p.add_argument(
        "--slo-tbt-ms", type=float, default=DEFAULT_TBT_S * 1e3, metavar="MS",
        help="time-between-tokens objective, checked on each request's TPOT as vLLM's goodput does (default %(default)g)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0, metavar="S", help="prompt synthesis seed (default 0)")
    p.add_argument(
        "--find-capacity", action="store_true",
        help="search the time scale for the highest load meeting --target-attainment",
    )  # fmt: skip
    p.add_argument(
        "--target-attainment", type=fraction, default=defaults.target_attainment, metavar="F",
        help=f"with --find-capacity: the share of requests sent that must meet both SLOs (default {TARGET_ATTAINMENT})",
    )  # fmt: skip
    p.add_argument(
        "--max-probes", type=positive_int, default=defaults.max_probes, metavar="N",
        help=f"with --find-capacity: runs the search may make (default {MAX_PROBES})",
    )  # fmt: skip
    p.add_argument(
        "--start-scale", type=positive_float, default=defaults.start_scale, metavar="X",
        help=f"with --find-capacity: the first probe's time scale (default {defaults.start_scale_shown:g})",
    )  # fmt: skip
    p.add_argument(
        "--max-scale", type=positive_float, default=None, metavar="X",
        help="with --find-capacity: the lightest load probed, as a time scale (default 8 x --start-scale); "
        "a lighter probe takes longer, and a server failing there has no capacity",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=None, metavar="DIR", help=f"where results go (default {defaults.out})")


def run(args: argparse.Namespace) -> int:
    from kvserve.replay.client import Endpoint
    from kvserve.replay.history import load_history
    from kvserve.replay.report import bands_table, run_name, runs_table
    from kvserve.replay.sweep import SweepSettings, run_sweep, write_outputs
    from kvserve.replay.trace import load_trace
    from libs.protocol.slo import SLO

    search_options = {"--target-attainment": args.target_attainment, "--max-probes": args.max_probes,
                      "--start-scale": args.start_scale, "--max-scale": args.max_scale}  # fmt: skip
    if args.find_capacity and args.time_scale is not None:
        args.usage_error("--find-capacity chooses the time scales itself: give --start-scale, not --time-scale")
    if args.max_scale is not None and args.max_scale < (args.start_scale or 1.0):
        args.usage_error(f"--max-scale {args.max_scale:g} is below the start scale {args.start_scale or 1.0:g}")
    if not args.find_capacity and any(v is not None for v in search_options.values()):
        given = [k for k, v in search_options.items() if v is not None]
        args.usage_error(f"{', '.join(given)} {'apply' if len(given) > 1 else 'applies'} only with --find-capacity")
    try:
        history = load_history(args.trace, args.start) if args.warm_history else ()
    except ValueError as e:
        args.usage_error(str(e))
    requests = load_trace(args.trace, args.max_requests, args.start)
    settings = SweepSettings(
        vocab=load_vocab(args.tokenizer),
        time_scales=args.time_scale or [1.0],
        block_tokens=args.block_tokens,
        seed=args.seed,
        max_input=args.max_input,
        max_output=args.max_output,
        spread=args.spread,
        slo=SLO.from_ms(args.slo_ttft_ms, args.slo_tbt_ms),
        history=history,
    )
    endpoint = Endpoint(args.base_url, args.model, args.api_key, args.timeout)
    out = args.out or Path("bench/out") / time.strftime("bench-%Y%m%d-%H%M%S")
    label = args.label or args.base_url
    if args.find_capacity:
        return find_capacity(args, endpoint, requests, settings, out, label)
    results = run_sweep(
        endpoint, requests, settings, label=label, out_dir=out, trace_name=str(args.trace), progress=args.progress
    )
    written = write_outputs(results, out, title=f"kvserve bench: {label}")
    print(runs_table([summary for _, summary in results]))
    print(bands_table([(run_name(summary), summary) for _, summary in results]))
    print("wrote " + ", ".join(str(p) for p in written) + f" and one JSON file per run in {out}")
    return 0 if all(s.completed for _, s in results) else 1


def find_capacity(
    args: argparse.Namespace,
    endpoint: "Endpoint",
    requests: "list[TraceRequest]",
    settings: "SweepSettings",
    out: Path,
    label: str,
) -> int:
    from kvserve.replay import capacity
    from kvserve.replay.report import capacity_bands, capacity_verdict, probes_table
    from kvserve.replay.sweep import capacity_measure, write_capacity_outputs

    measure = capacity_measure(
        endpoint, requests, settings, label=label, out_dir=out, trace_name=str(args.trace), progress=args.progress
    )
    result = capacity.find_capacity(
        measure,
        start_scale=args.start_scale or 1.0,
        max_probes=args.max_probes or MAX_PROBES,
        target=args.target_attainment or TARGET_ATTAINMENT,
        max_scale=args.max_scale,
        label=label,
    )
    written = write_capacity_outputs(result, settings.slo, out, title=f"kvserve bench --find-capacity: {label}")
    print(probes_table(result))
    print(capacity_verdict(result))
    print(capacity_bands(result))
    print("wrote " + ", ".join(str(p) for p in written) + f" and one JSON file per probe in {out}")
    return 0 if any(p.summary and p.summary.completed for p in result.probes) else 1


def load_vocab(spec: str | None) -> list[int]:
    """The ordinary token ids of a tokenizer: a tokenizer.json, a HF folder, or the default model."""
    from kvserve.replay.prompts import ordinary_vocab
    from libs.engine.model.default_model import resolve_model_path

    path = Path(spec) if spec is not None else resolve_model_path(None)[0]
    tok_file = path if path.is_file() else path / "tokenizer.json"
    if tok_file.suffix != ".json" or not tok_file.exists():
        raise KVServeError(f"no tokenizer.json at {spec}: give a Hugging Face folder or its tokenizer.json")
    return ordinary_vocab(tok_file.read_text())


def input_cap(text: str) -> int | None:
    """``--max-input``: a cap in tokens, or None (no cap) for 0."""
    return count(text) or None


def _non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {text}")
    return value
