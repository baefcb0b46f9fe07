"""bench/replay.py's kvserve-baseline configuration: an earlier kvserve checkout
(a `git worktree` of a previous main, say) measured by its own bench/replay.py,
as a subprocess on its own code (``PYTHONPATH`` = the checkout), on its
kvserve-default configuration, with this invocation's window, loads or search
and SLOs; its runs are read back and reported as kvserve-baseline. Nothing here
starts a server; the older script does, and stops it."""

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from kvserve.replay.capacity import Capacity, Probe
from kvserve.replay.metrics import Summary, summarize
from kvserve.replay.records import Run
from kvserve.replay.sweep import SweepSettings, unit_offered_rps
from kvserve.replay.trace import TraceRequest

NAME = "kvserve-baseline"
# An older bench/replay.py has no `--max-input 0`; a cap above any prompt is the same.
UNCAPPED = 100_000


def usage_error(args: argparse.Namespace) -> str | None:
    """Why --baseline and --configs do not fit together; None when they do."""
    if args.baseline is None:
        return f"{NAME} needs --baseline PATH" if NAME in (args.configs or ()) else None
    if not (args.baseline / "bench" / "replay.py").is_file():
        return f"--baseline {args.baseline}: no bench/replay.py there (give a kvserve checkout)"
    if args.configs is not None and NAME not in args.configs:
        return f"--baseline runs as {NAME}: name it in --configs too"
    return None


def measure(
    args: argparse.Namespace, requests: Sequence[TraceRequest], settings: SweepSettings
) -> tuple[list[tuple[Run, Summary]], Capacity | None, str]:
    """Run the baseline into --out/kvserve-baseline: its runs with their summaries,
    its search (with --find-capacity), and what went wrong, for its note."""
    out = args.out / NAME
    runs, code = run(args, out)
    results = [(r, summarize(r, settings.slo, settings.block_tokens)) for r in runs]
    problem = f"; its bench/replay.py exited with code {code} (see {out / 'replay.log'})" if code else ""
    if not results:
        return [], None, problem + "; it left no runs"
    found = None
    if args.find_capacity:
        unit_rps = unit_offered_rps(requests, settings.spread)
        found = capacity([s for _, s in results], args.target_attainment, unit_rps)
        if found.best is not None and args.beyond:  # its own sweep at those loads, seeds as the others'
            runs, code = run(args, args.out / "beyond" / NAME, [found.best.time_scale / f for f in args.beyond])
            problem += f"; its probes beyond capacity exited with code {code}" if code else ""
            more = [(r, summarize(r, settings.slo, settings.block_tokens)) for r in runs]
            found = replace(found, beyond=probes([s for _, s in more], unit_rps))
            results += more
    return results, found, problem


def command(args: argparse.Namespace, out: Path, scales: Sequence[float] = ()) -> list[str]:
    """The older checkout's bench/replay.py command line, with this interpreter,
    writing its runs, log and report into ``out``; with ``scales``, a sweep at those
    time scales whose seeds follow the search's probes (this search's --beyond)."""
    cmd = [
        sys.executable, str(args.baseline.resolve() / "bench" / "replay.py"), "--configs", "kvserve-default",
        "--trace", str(args.trace.resolve()), "--start", str(args.start), "--requests", str(args.requests),
        "--block-tokens", str(args.block_tokens), "--max-input", str(args.max_input or UNCAPPED),
        "--max-output", str(args.max_output), "--slo-ttft-ms", str(args.slo_ttft_ms),
        "--slo-tbt-ms", str(args.slo_tbt_ms), "--seed", str(args.seed + (args.max_probes if scales else 0)),
        "--dtype", args.dtype,
        "--request-timeout", str(args.request_timeout),
    ]  # fmt: skip
    if args.warm_history:
        cmd.append("--warm-history")
    if not args.spread:
        cmd.append("--no-spread")
    if args.worker_threads:
        cmd += ["--worker-threads", str(args.worker_threads)]
    if scales:
        cmd += ["--time-scales", *(str(x) for x in scales)]
    elif args.find_capacity:
        cmd += ["--find-capacity", "--target-attainment", str(args.target_attainment),
                "--max-probes", str(args.max_probes), "--start-scale", str(args.start_scale)]  # fmt: skip
        if args.max_scale is not None:
            cmd += ["--max-scale", str(args.max_scale)]
        cmd += ["--capacity-report", str(out.resolve() / "capacity.md")]
    else:
        cmd += ["--time-scales", *(str(x) for x in args.time_scales)]
    return cmd + ["--out", str(out.resolve())]


def environment(args: argparse.Namespace) -> dict[str, str]:
    """This environment with the older checkout alone on the Python path."""
    return {**os.environ, "PYTHONPATH": str(args.baseline.resolve())}


def run(args: argparse.Namespace, out: Path, scales: Sequence[float] = ()) -> tuple[list[Run], int]:
    """Run the older bench/replay.py to its end; its runs that started after the launch, and its exit code."""
    out.mkdir(parents=True, exist_ok=True)
    launched = time.time()
    with (out / "replay.log").open("w") as log:
        # its own session: a Ctrl-C here reaches it once, as the SIGTERM below, which stops its servers
        proc = subprocess.Popen(command(args, out, scales), env=environment(args), cwd=args.baseline.resolve(),
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)  # fmt: skip
        try:
            code = proc.wait()
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGTERM)
            proc.wait()
            raise
    return load_runs(out, since=launched), code


def load_runs(out: Path, since: float | None = None) -> list[Run]:
    """The run files in ``out`` (those started at or after ``since``, when they say
    when they started), labelled kvserve-baseline, in the order they ran: run i has seed seed+i."""
    runs = [Run.load(path) for path in sorted(out.glob("*-x*.json"))]
    runs = [r for r in runs if since is None or r.settings.get("started_at", since) >= since]
    for r in runs:
        r.label = NAME
    return sorted(runs, key=lambda r: r.settings.get("seed", 0))


def capacity(summaries: Sequence[Summary], target: float, unit_rps: float) -> Capacity:
    """The older search's probes, in the order it ran them, as this search's result."""
    return Capacity(NAME, target, probes(summaries, unit_rps))


def probes(summaries: Sequence[Summary], unit_rps: float) -> tuple[Probe, ...]:
    """The older script's runs as probes; ``unit_rps`` is the window's offered rate at
    time scale 1 (for a run that does not say its own)."""
    return tuple(
        Probe(s.time_scale, s.offered_rps if s.offered_rps is not None else unit_rps / s.time_scale,
              s.slo_attainment, s.goodput_rps, s)
        for s in summaries
    )  # fmt: skip


def revision(checkout: Path) -> str:
    """The checkout's commit, for the report; "" where git cannot tell."""
    try:
        done = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=30)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""
