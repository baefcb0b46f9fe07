"""Side by side on one trace window, at the same loads, on this machine: kvserve
as `kvserve up` starts it (its default policy), kvserve disaggregated (store +
cache-aware conductor), kvserve with prefix caching off,
kvserve with one colocated worker (`kvserve up --prefill 0`: one decode worker on
every core prefilling its own requests), and llama.cpp's llama-server on the same GGUF.

Each configuration is started, warmed up, swept over the time scales with
`kvserve bench`'s library (run i uses prompt seed seed+i in every configuration,
so all see identical prompts at a given load and no run hits an earlier run's
cache), and stopped before the next one starts. Per-request JSON, summary.md,
comparison.md and the plots go to --out; optional py-spy profiles of every
kvserve service during the first load go there too.

    .venv/bin/python bench/replay.py --requests 200 --time-scales 8 4 2

--find-capacity searches each configuration's effective request capacity
instead of sweeping (`kvserve bench --find-capacity`'s search; probe i with seed
seed+i in every configuration) and writes bench/results/capacity.md (or
--capacity-report) with capacity.png beside it:

    .venv/bin/python bench/replay.py --requests 120 --find-capacity --start-scale 4 --max-probes 6

--beyond F [F ...] then probes each configuration at F times its capacity (the
same prompt seed for every configuration at a factor; files in --out/beyond): what
admission keeps past the capacity, reported under "Beyond capacity", with peak
goodput at any load tried:

    .venv/bin/python bench/replay.py --find-capacity --beyond 2 4 --max-input 0 --block-tokens 8

--start I --warm-history takes the window from the trace's steady state: before
each run it sends the prefixes the window shares with requests 0..I-1, the cache a
server holds after serving the trace up to I (the first requests of a trace meet a
cold cache).

Before any server starts, the machine's prefill speed is measured as
`bench/engine.py --prefill-speed` measures it (what `kvserve up` serves, 2,048
tokens) and written beside the results: a capacity is only worth what the machine
under it prefills.

--baseline PATH adds kvserve-baseline: the kvserve checkout at PATH (a `git
worktree` of an earlier main, say) measured by its own bench/replay.py on its
kvserve-default configuration with the same window, loads or search and SLOs
(bench/baseline.py), its files in --out/kvserve-baseline, reported beside the
others:

    git worktree add ../kvserve-before <commit>
    .venv/bin/python bench/replay.py --find-capacity --baseline ../kvserve-before \
        --configs kvserve-baseline kvserve-default
"""

import argparse
import contextlib
import datetime
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import baseline  # noqa: E402
from bench.capacity import document as capacity_document  # noqa: E402
from bench.cpu_use import cpu_line, cpu_seconds, machine_busy_seconds, start_profiles, top_frames  # noqa: E402
from bench.engine import cpu_name  # noqa: E402
from bench.llama_server import LLAMA_ARGS, llama_server  # noqa: E402
from kvserve.cli.bench import (  # noqa: E402
    MAX_PROBES,
    TARGET_ATTAINMENT,
    WorkloadDefaults,
    add_workload_options,
    load_vocab,
)
from kvserve.cli.cluster import LocalCluster  # noqa: E402
from kvserve.cli.cpus import default_shared_prefill  # noqa: E402
from kvserve.cli.options import positive_int  # noqa: E402
from kvserve.replay.capacity import Capacity, find_capacity, probe_beyond  # noqa: E402
from kvserve.replay.capacity import validate as validate_search  # noqa: E402
from kvserve.replay.client import Endpoint, plan, replay  # noqa: E402
from kvserve.replay.history import load_history, shared_prefixes  # noqa: E402
from kvserve.replay.metrics import Summary, goodput_at_attainment, summarize  # noqa: E402
from kvserve.replay.plots import capacity_curves  # noqa: E402
from kvserve.replay.prompts import PromptSynthesizer  # noqa: E402
from kvserve.replay.records import Run  # noqa: E402
from kvserve.replay.report import bands_table, capacity_verdict, probes_table, run_name, runs_table  # noqa: E402
from kvserve.replay.sweep import (  # noqa: E402
    SweepSettings,
    capacity_measure,
    run_sweep,
    unit_offered_rps,
    write_outputs,
)
from kvserve.replay.trace import load_trace  # noqa: E402
from libs.common.cpu_share import format_cpu_list  # noqa: E402
from libs.engine.model.loader import resolve_dtype  # noqa: E402
from libs.protocol.errors import KVServeError  # noqa: E402
from libs.protocol.models import DEFAULT_MODEL_ID  # noqa: E402
from libs.protocol.slo import SLO  # noqa: E402

DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl"


@dataclass
class Config:
    name: str
    what: str
    kind: str  # "kvserve" or "llama"
    cluster: dict = field(default_factory=dict)  # LocalCluster arguments
    env: dict[str, str] = field(default_factory=dict)
    note: str = ""


def policy_exists(spec: str) -> bool:
    """Whether this checkout's conductor accepts ``KVSERVE_POLICY=spec``."""
    from services.conductor.admission_policy import build_policy

    try:
        build_policy(spec)
    except ValueError:
        return False
    return True


LOCAL_PREFILL_POLICY = "cache_aware+local_prefill+predictive_rejection"


def configs(worker_threads: int | None, baseline_path: Path | None = None) -> list[Config]:
    """Every configuration, in the reports' order; kvserve-baseline only with a checkout to run."""
    threads = {"OMP_NUM_THREADS": str(worker_threads)} if worker_threads else {}
    policy = "cache_aware" if policy_exists("cache_aware") else "least_loaded"
    note = "" if policy == "cache_aware" else "no cache_aware policy in this checkout: ran least_loaded"
    host = tuple(sorted(os.sched_getaffinity(0)))
    shared = default_shared_prefill(1, 1, host)
    out = [
        Config("kvserve-default", f"kvserve 1 prefill + 1 decode"
               f"{f' + {shared} at low priority on the decode core' if shared else ''}, "
               "store, as `kvserve up` configures them", "kvserve",
               dict(prefill=1, decode=1, store=True, shared_prefill=shared), {**threads}),
        Config("kvserve-no-shared-prefill", "kvserve up --shared-prefill 0: 1 prefill + 1 decode, store", "kvserve",
               dict(prefill=1, decode=1, store=True), {**threads}),
        Config("kvserve-disagg", "kvserve 1 prefill + 1 decode, store, prefix cache on", "kvserve",
               dict(prefill=1, decode=1, store=True), {"KVSERVE_POLICY": policy, **threads}, note),
        Config("kvserve-nocache", "kvserve 1 prefill + 1 decode, no store, prefix cache off", "kvserve",
               dict(prefill=1, decode=1, store=False), {"KVSERVE_ENABLE_PREFIX_CACHE": "0", **threads}),
    ]  # fmt: skip
    if baseline_path is not None:
        commit = baseline.revision(baseline_path)
        out.insert(1, Config(baseline.NAME, "an earlier checkout's kvserve-default, by its own bench/replay.py",
                             "baseline", note=f"{baseline_path}{f' at {commit}' if commit else ''}, run by its own "
                             "bench/replay.py --configs kvserve-default"))  # fmt: skip
    # two ways of giving prefill what the decode worker leaves idle (bench/results/local-prefill.md)
    out.append(Config("kvserve-local-prefill", "kvserve-no-shared-prefill with KVSERVE_POLICY=" + LOCAL_PREFILL_POLICY
                      + " and KVSERVE_LOCAL_CHUNK_TOKENS=64: the decode worker prefills a request itself, 64 tokens "
                      "between two decode steps, when that is predicted sooner", "kvserve",
                      dict(prefill=1, decode=1, store=True),
                      {"KVSERVE_POLICY": LOCAL_PREFILL_POLICY, "KVSERVE_LOCAL_CHUNK_TOKENS": "64", **threads}))
    out.append(Config("kvserve-wide-prefill", f"kvserve-no-shared-prefill with --cpus prefill={format_cpu_list(host)},"
                      f"decode={host[-1]}: the prefill worker on every core, the decode worker on the last",
                      "kvserve", dict(prefill=1, decode=1, store=True, cpus={"prefill": host, "decode": host[-1:]}),
                      {**threads}))  # fmt: skip
    # `kvserve up --prefill 0`: the conductor, never hearing from a prefill worker, prefills on decode
    out.append(
        Config("kvserve-colocated", "kvserve up --prefill 0: one decode worker on every core, prefilling its own "
               "requests, store on", "kvserve", dict(prefill=0, decode=1, store=True), {**threads})  # fmt: skip
    )
    out.append(
        Config("kvserve-colocated-64", "kvserve-colocated with KVSERVE_LOCAL_CHUNK_TOKENS=64: prefill chunks of 64 "
               "tokens between two decode steps, not 512 (measured worse, bench/results/local-prefill.md)", "kvserve",
               dict(prefill=0, decode=1, store=True), {"KVSERVE_LOCAL_CHUNK_TOKENS": "64", **threads})  # fmt: skip
    )
    out.append(Config("llama.cpp", f"llama-server {' '.join(LLAMA_ARGS)}", "llama"))
    return out


# --- servers --------------------------------------------------------------------------
@contextlib.contextmanager
def kvserve(config: Config, log_path: Path, dtype: str) -> Iterator[tuple[str, dict[str, int]]]:
    # A fresh disk tier per configuration: the store keeps its blocks across restarts,
    # so a shared one would hand a later configuration every prompt an earlier one stored.
    with log_path.open("w") as log, tempfile.TemporaryDirectory(prefix="kvserve-bench-stores-") as stores:
        # supervised as `kvserve up` runs it: a process that exits is started again
        cluster = LocalCluster(gateway_port=0, log=log, env=config.env, dtype=dtype, store_dir=stores, supervise=True,
                               **config.cluster)  # fmt: skip
        cluster.start(timeout=180)
        try:
            yield cluster.gateway_url, cluster.pids
        finally:
            cluster.stop()


# --- the comparison -------------------------------------------------------------------
def warm_up(endpoint: Endpoint, requests, settings: SweepSettings) -> None:
    synth = PromptSynthesizer(settings.vocab, settings.block_tokens, 10_000, settings.max_input, settings.max_output)
    import asyncio

    for request in requests[:3]:  # one at a time: first-call costs, not load
        asyncio.run(replay(endpoint, plan([request], synth, 0.0), progress=False))


def comparison(results: dict[str, list[Summary]], target: float) -> str:
    lines = [
        f"| configuration | goodput at {target:.0%} SLO attainment (req/s) | at time scale | offered req/s |",
        "|---|---:|---:|---:|",
    ]
    best = {name: goodput_at_attainment(summaries, target) for name, summaries in results.items()}
    for name, b in best.items():
        lines.append(
            f"| {name} | {b.goodput_rps:.3f} | {b.time_scale:g} | {b.offered_rps:.2f} |"
            if b else f"| {name} | none of the loads reached {target:.0%} | – | – |"
        )  # fmt: skip
    return "\n".join(lines) + "\n"


def chosen(all_configs: list[Config], names: list[str] | None) -> list[Config]:
    """The configurations named, in the order given; all of them without names."""
    if names is None:
        return all_configs
    by_name = {c.name: c for c in all_configs}
    return [by_name[name] for name in names if name in by_name]


def report_only(out: Path, slo: SLO) -> int:
    """The reports of the runs already in ``out`` (one JSON file per run, the
    baseline's in its subfolder), in configuration order."""
    order = [c.name for c in configs(None)]
    order.insert(1, baseline.NAME)  # where --baseline puts it
    runs = [Run.load(path) for path in sorted(out.glob("*-x*.json"))] + baseline.load_runs(out / baseline.NAME)
    runs.sort(key=lambda r: (order.index(r.label) if r.label in order else len(order), -r.time_scale))
    results = [(run, summarize(run, slo, int(run.settings.get("block_tokens", 16)))) for run in runs]
    write_outputs(results, out, title="Trace replay: kvserve against llama.cpp")
    by_config: dict[str, list[Summary]] = {}
    for _, summary in results:
        by_config.setdefault(summary.label, []).append(summary)
    summaries = [s for _, s in results]
    text = [comparison(by_config, 0.9), runs_table(summaries), bands_table([(run_name(s), s) for s in summaries])]
    (out / "comparison-report.md").write_text("\n".join(text))
    print("\n".join(text))
    return 0


def machine_note(reps: int = 3) -> str:
    """The CPU and its prefill speed as `bench/engine.py --prefill-speed` measures it
    (a fresh process, before any server starts; the median of ``reps``)."""
    command = [sys.executable, str(ROOT / "bench" / "engine.py"), "--prefill-speed", "--reps", str(reps)]
    out = subprocess.run(command, cwd=ROOT,
                         capture_output=True, text=True, timeout=900)  # fmt: skip
    lines = out.stdout.strip().splitlines()
    speed = json.loads(lines[-1]) if out.returncode == 0 and lines else {"error": out.stderr.strip()[-300:]}
    measured = (f"{speed['tok_s']:,.0f} tokens/s at 2,048 tokens ({speed['variant']}, {speed['dtype']})"
                if speed.get("tok_s") else f"not measured ({speed.get('error')})")  # fmt: skip
    return f"CPU {cpu_name()}; its prefill speed (`bench/engine.py --prefill-speed`): {measured}"


def write_capacity(args, capacities, settings, started, requests, notes, cpu_notes, machine: str) -> int:
    report = args.capacity_report
    report.parent.mkdir(parents=True, exist_ok=True)
    plot = capacity_curves(list(capacities.values()), report.with_suffix(".png"))
    first, last = requests[0].index, requests[-1].index
    window = (
        f"{started:%Y-%m-%d %H:%M %Z} on {platform.node()}, {os.cpu_count()} CPUs, load average at start "
        f"{os.getloadavg()[0]:.2f}. Trace `{args.trace.name}` requests {first}-{last}, "
        f"{settings.block_tokens}-token blocks, {input_note(settings.max_input)}, at most "
        f"{settings.max_output} output tokens{', bucketed arrivals spread' if settings.spread else ''}; "
        f"kvserve in {args.dtype}.{warmed_note(settings, requests)} {machine}."
    )
    note_lines = [f"{name}: {note}" for name, note in notes.items() if note]
    text = capacity_document(
        capacities, settings.slo, heading="Effective request capacity: kvserve against llama.cpp",
        command=f".venv/bin/python {shlex.join(sys.argv)}", window=window, plot_name=plot.name,
        notes=[*note_lines, "CPU seconds during each search (from /proc): "
               + "; ".join(line.removeprefix("- ") for line in cpu_notes)],
    )  # fmt: skip
    report.write_text(text)
    print(text)
    print(f"wrote {report}, {plot} and one JSON file per probe in {args.out}")
    return 0


def input_note(max_input: int | None) -> str:
    return "inputs uncapped (the trace's lengths scaled)" if max_input is None else f"inputs at most {max_input} tokens"


def warmed_note(settings: SweepSettings, requests) -> str:
    """What the window reuses: from its own earlier requests, and from the warmed history."""
    synth = PromptSynthesizer(settings.vocab, settings.block_tokens, settings.seed, settings.max_input,
                              settings.max_output)  # fmt: skip
    prefixes = shared_prefixes(settings.history, requests, synth)
    total = sum(synth.input_length(r) for r in requests)
    own = sum(p.record.cached_blocks_expected for p in plan(requests, synth, 1.0)) * settings.block_tokens
    warm = sum(p.record.cached_blocks_expected for p in plan(requests, synth, 1.0, warmed=prefixes))
    text = f" Reusable prompt tokens: {own:,} of {total:,} ({own / total:.1%}) from the window's own earlier requests"
    if not settings.history:
        return text + "; cold cache."
    warm *= settings.block_tokens
    return (text + f", {warm:,} ({warm / total:.1%}) with the history: before each probe, the "
            f"{len(prefixes)} prefixes ({sum(map(len, prefixes)) * settings.block_tokens:,} tokens) the window shares "
            f"with requests 0-{len(settings.history) - 1} were sent, one at a time, one output token each.")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM stops the servers as Ctrl-C does


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_options(ap, WorkloadDefaults(
        trace=DEFAULT_TRACE, max_input="1024", max_output=16, target_attainment=TARGET_ATTAINMENT,
        max_probes=MAX_PROBES, start_scale=4.0, start_scale_shown=4.0,
        out="bench/out/replay, with --find-capacity bench/out/capacity",
    ))  # fmt: skip
    ap.add_argument("--requests", type=positive_int, default=200, help="trace window length (default 200)")
    ap.add_argument("--time-scales", type=float, nargs="+", default=[8.0, 4.0, 2.0])
    ap.add_argument("--no-spread", dest="spread", action="store_false",
                    help="replay the trace's bucketed timestamps as bursts (default: spread each bucket)")
    ap.add_argument("--configs", nargs="+", default=None,
                    help="names to run, in this order (default all: kvserve-default, kvserve-baseline with --baseline, "
                    "kvserve-no-shared-prefill, kvserve-disagg, kvserve-nocache, kvserve-local-prefill, "
                    "kvserve-wide-prefill, kvserve-colocated, kvserve-colocated-64, llama.cpp)")
    ap.add_argument("--baseline", type=Path, default=None, metavar="PATH",
                    help="add kvserve-baseline: the kvserve checkout at PATH measured by its own bench/replay.py "
                    "(PYTHONPATH=PATH, this interpreter) on its kvserve-default configuration with the same window, "
                    "loads or search and SLOs, into --out/kvserve-baseline")
    ap.add_argument("--dtype", default="auto",
                    help="kvserve's dtype (default auto: what `kvserve up` picks on this CPU, decided once here "
                    "before any server starts, so a busy machine cannot make configurations differ)")
    ap.add_argument("--worker-threads", type=int, default=None, help="OMP_NUM_THREADS for kvserve services")
    ap.add_argument("--profile-seconds", type=int, default=0, help="py-spy every kvserve service during the first load")
    ap.add_argument("--request-timeout", type=float, default=900.0,
                    help="seconds a request may take in all; past it, it is an error (never good anyway)")
    ap.add_argument("--report-only", action="store_true",
                    help="run nothing: rebuild summary.md, comparison.md and the plots from the JSON in --out")
    ap.add_argument("--beyond", type=float, nargs="+", default=[], metavar="FACTOR",
                    help="with --find-capacity: then probe each configuration at these multiples of its capacity "
                    "(e.g. 2 4; default none)")
    ap.add_argument("--capacity-report", type=Path, default=ROOT / "bench" / "results" / "capacity.md",
                    help="with --find-capacity: where the comparison goes, its plot beside it as .png "
                    "(default bench/results/capacity.md)")
    return ap


def main() -> int:
    signal.signal(signal.SIGTERM, _interrupt)
    ap = parser()
    args = ap.parse_args()
    if args.out is None:
        args.out = ROOT / "bench" / "out" / ("capacity" if args.find_capacity else "replay")
    if args.find_capacity:
        try:
            validate_search(start_scale=args.start_scale, max_probes=args.max_probes, target=args.target_attainment,
                            max_scale=args.max_scale)  # fmt: skip
        except ValueError as e:
            ap.error(str(e))
    if args.beyond and (not args.find_capacity or min(args.beyond) <= 0):
        ap.error("--beyond takes positive factors and needs --find-capacity")
    if error := baseline.usage_error(args):
        ap.error(error)
    if args.dtype == "auto":
        args.dtype = str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")
    if args.report_only:
        return report_only(args.out, SLO.from_ms(args.slo_ttft_ms, args.slo_tbt_ms))

    if not args.trace.exists():
        raise SystemExit(f"no trace at {args.trace}")
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        history = load_history(args.trace, args.start) if args.warm_history else ()
    except ValueError as e:
        ap.error(str(e))
    requests = load_trace(args.trace, args.requests, args.start)
    if args.find_capacity:
        try:
            unit_offered_rps(requests, args.spread)  # before any server starts
        except KVServeError as e:
            ap.error(str(e))
    settings = SweepSettings(
        vocab=load_vocab(None), time_scales=args.time_scales, block_tokens=args.block_tokens, seed=args.seed,
        max_input=args.max_input, max_output=args.max_output, spread=args.spread, slo=SLO.from_ms(args.slo_ttft_ms, args.slo_tbt_ms),
        history=history,
    )  # fmt: skip
    started = datetime.datetime.now().astimezone()
    print(f"{started:%Y-%m-%d %H:%M %Z} on {platform.node()}, {os.cpu_count()} CPUs, load {os.getloadavg()}")
    machine = machine_note()
    print(machine, flush=True)
    all_results, by_config, notes, cpu_notes = [], {}, {}, []
    capacities: dict[str, Capacity] = {}
    for config in chosen(configs(args.worker_threads, args.baseline), args.configs):
        notes[config.name] = config.note
        if config.note.endswith("not run"):
            print(f"{config.name}: {config.note}")
            continue
        if config.kind == "baseline":
            results, found, note = baseline.measure(args, requests, settings)
            notes[config.name] += note
            if found is not None:
                capacities[config.name] = found
            cpu_notes.append(f"- {config.name}: not measured (its own bench/replay.py ran it)")
        else:
            server = kvserve(config, args.out / f"{config.name}.log", args.dtype) if config.kind == "kvserve" else (
                llama_server(args.out / f"{config.name}.log"))  # fmt: skip
            with server as (url, pids):
                endpoint = Endpoint(url, DEFAULT_MODEL_ID, None, timeout_s=args.request_timeout)
                warm_up(endpoint, requests, settings)
                cpu_before = {k: cpu_seconds(pid) for k, pid in pids.items()} | {"machine": machine_busy_seconds()}
                wall_start = time.monotonic()
                profilers = []
                if args.profile_seconds and config.kind == "kvserve":
                    profilers = start_profiles(pids, args.profile_seconds, args.out, config.name)
                if args.find_capacity:
                    measure = capacity_measure(endpoint, requests, settings, label=config.name, out_dir=args.out,
                                               trace_name=str(args.trace))  # fmt: skip
                    found = find_capacity(
                        measure, start_scale=args.start_scale, max_probes=args.max_probes,
                        target=args.target_attainment, max_scale=args.max_scale, label=config.name,
                    )  # fmt: skip
                    beyond = capacity_measure(endpoint, requests, settings, label=config.name,
                                              out_dir=args.out / "beyond", trace_name=str(args.trace))  # fmt: skip
                    found = capacities[config.name] = probe_beyond(found, beyond, args.beyond, args.max_probes)
                    results = [(None, p.summary) for p in (*found.probes, *found.beyond)]
                else:
                    results = run_sweep(endpoint, requests, settings, label=config.name, out_dir=args.out,
                                        trace_name=str(args.trace))  # fmt: skip
                for p in profilers:
                    p.wait()
                cpu_after = {k: cpu_seconds(pid) for k, pid in pids.items()} | {"machine": machine_busy_seconds()}
                cpu_notes.append(cpu_line(config.name, cpu_before, cpu_after, time.monotonic() - wall_start))
        all_results += results
        by_config[config.name] = [s for _, s in results]
        print(runs_table(by_config[config.name]))
        if config.name in capacities:
            print(probes_table(capacities[config.name]) + capacity_verdict(capacities[config.name]))
    if args.find_capacity:
        return write_capacity(args, capacities, settings, started, requests, notes, cpu_notes, machine)
    write_outputs(all_results, args.out, title="Trace replay: kvserve against llama.cpp")
    text = [
        f"# Trace replay comparison, {started:%Y-%m-%d %H:%M %Z}\n",
        f"`{' '.join(sys.argv)}` — load average at start {os.getloadavg()[0]:.2f}\n",
        comparison(by_config, 0.9),
        runs_table([s for _, s in all_results]),
        bands_table([(run_name(s), s) for _, s in all_results]),
        *(f"- {name}: {note}" for name, note in notes.items() if note),
        "\nCPU seconds during each sweep (from /proc; the pids LocalCluster or llama-server report):\n",
        *cpu_notes,
    ]
    for path in sorted(args.out.glob("profile-*.txt")):
        text.append(f"\n{path.name}: " + ", ".join(f"{f} {share:.0%}" for f, share in top_frames(path, 8)))
    (args.out / "comparison.md").write_text("\n".join(text) + "\n")
    print("\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
