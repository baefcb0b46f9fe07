"""The conductor's benchmark: admit-decision latency at scale, the simulator's
wall time on the full shared trace, its policy table at two loads, and the
scenarios built to tell admission and replication policies apart.

    .venv/bin/python bench/conductor.py [--sections admit,scale1,...] [--trace T.jsonl] [--out conductor.md]
                                        [--baseline DIR]

1. Admit latency: one Admitter with 64 instances (48 prefill, 15 decode, 1 store)
   and 1,000,000 blocks in its KV index; 20,000 admissions of 64-block prompts whose
   cached prefixes vary; requests are settled 512 admissions later, so the
   conductor's load records stay at a steady size. Timed: `Admitter.admit` alone,
   and with the AdmitRequest decoded and the AdmitReply encoded (msgpack) around it.
2. Simulator wall time: the full trace at 16 prefill + 16 decode, per policy.
3. The policy table on the full trace at two loads (time scale 1 and 0.5), then
   without a store (where replication matters), on a decode-bound cluster
   (16 prefill + 2 decode, where early rejection matters) and with workers 1.5x
   slower than the cost model they report (where admission must learn).
4. Scenarios (`services/conductor/simulator/scenarios.py`): a swinging load that
   fills one decode batch while prefills are in flight (early against predictive
   rejection), and hot prefixes on small caches without a store (replication).
5. Scale: the full trace at 64 and 1,024 prefill + decode instances, with and
   without a store (the hit rate the store keeps as instances multiply), each in a
   process of its own (`bench/conductor_scale.py`), beside the conductor of another
   checkout (``--baseline DIR``) where given: run time, admit CPU time, routing.
Each section takes under a minute here but the scale section (minutes at 1,024
instances); --sections runs some and keeps the rest.
"""

import argparse
import datetime
import json
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from libs.engine.cost_model import uncalibrated_coefficients  # noqa: E402
from libs.protocol import schema  # noqa: E402
from libs.protocol.schema import AdmitReply, AdmitRequest, DecodeBeat, Heartbeat, PrefillBeat, StoreBeat  # noqa: E402
from services.conductor.admission_policy import build_policy  # noqa: E402
from services.conductor.admitter import Admitter, AdmitterConfig  # noqa: E402
from services.conductor.cluster import ClusterView  # noqa: E402
from services.conductor.index import KVIndex  # noqa: E402
from services.conductor.margin import MarginConfig  # noqa: E402
from services.conductor.simulator.report import summarize, table  # noqa: E402
from services.conductor.simulator.scenarios import hot_prefix, swinging  # noqa: E402
from services.conductor.simulator.simulation import SimConfig, simulate  # noqa: E402
from services.conductor.simulator.trace import load_trace  # noqa: E402

POLICIES = ["random", "least_loaded", "cache_aware", "cache_aware+replication", "cache_aware+early_rejection",
            "cache_aware+predictive_rejection", "cache_aware+local_prefill+predictive_rejection"]  # fmt: skip


def admit_latency(policy: str, num_blocks: int = 1_000_000, admissions: int = 20_000) -> dict:
    rng = random.Random(0)
    now = [0.0]
    view = ClusterView(timeout=1e9, clock=lambda: now[0])
    cost = uncalibrated_coefficients(16)
    prefills = [f"prefill-{i}" for i in range(48)]
    for i in prefills:
        view.observe(Heartbeat(instance_id=i, role="prefill", host_id="h", payload=PrefillBeat(cost=cost, capacity=4096)))
    for i in range(15):
        view.observe(Heartbeat(instance_id=f"decode-{i}", role="decode", host_id="h",
                               payload=DecodeBeat(cost=cost, capacity=65536)))  # fmt: skip
    view.observe(Heartbeat(instance_id="store-0", role="store", host_id="h", payload=StoreBeat(cost=cost)))
    index = KVIndex()
    # 1M blocks as chains of 64 (a prompt's prefix); each chain cached whole on one prefill worker
    # and in part on up to two more, half of them in the store's DRAM tier and a quarter on its disk
    chains = []
    for c in range(num_blocks // 64):
        chain = [c.to_bytes(8, "little") + k.to_bytes(8, "little") for k in range(64)]
        chains.append(chain)
        first, *others = rng.sample(prefills, rng.randint(1, 3))
        index.add(first, "device", chain)
        for holder in others:
            index.add(holder, "device", chain[: rng.randint(8, 64)])
        if c % 2 == 0:
            index.add("store-0", "dram", chain[:48])
        if c % 4 == 1:
            index.add("store-0", "disk", chain)
    assert index.num_blocks == num_blocks
    # requests are settled by the clock of this loop, not by their real TTFTs: learning from that would
    # teach the conductor a nonsense margin (the reads of margins are timed all the same)
    learn_nothing = AdmitterConfig(margin=MarginConfig(window=0))
    scheduler = Admitter(build_policy(policy, random.Random(1)), view, index, learn_nothing)
    encoded = []
    for i in range(admissions):
        chain = chains[rng.randrange(len(chains))]
        keep = rng.randint(0, 64)
        hashes = chain[:keep] + [rng.randbytes(16) for _ in range(64 - keep)]
        request = AdmitRequest(request_id=f"r{i}", num_prompt_tokens=64 * 16 + 5, max_tokens=128, block_hashes=hashes)
        encoded.append(schema.encode(request))
    bare, wire, cpu = [], [], []
    for i, data in enumerate(encoded):
        now[0] += 0.02  # 50 requests a second: the 48 prefill workers keep up, few are refused
        t0 = time.perf_counter_ns()
        request = schema.decode(data, AdmitRequest)
        t1 = time.perf_counter_ns()
        c0 = time.thread_time_ns()
        d = scheduler.admit(request)
        c1 = time.thread_time_ns()
        t2 = time.perf_counter_ns()
        cpu.append(c1 - c0)
        schema.encode(AdmitReply(prefill_id=d.prefill_id, decode_id=d.decode_id, predicted_ttft_s=d.predicted_ttft_s,
                                 cached_tokens=d.cached_tokens))  # fmt: skip
        t3 = time.perf_counter_ns()
        bare.append(t2 - t1)
        wire.append(t3 - t0)
        if i >= 512:  # settle the request admitted 512 ago: first token, then its end
            old = f"r{i - 512}"
            scheduler.first_token(old)
            scheduler.finished(old)
    bare_us, wire_us, cpu_us = np.array(bare) / 1e3, np.array(wire) / 1e3, np.array(cpu) / 1e3
    return {
        "cpu_p50": np.percentile(cpu_us, 50), "cpu_p99": np.percentile(cpu_us, 99),
        "policy": policy, "admitted": scheduler.num_admitted, "rejected": sum(scheduler.rejections.values()),
        "p50": np.percentile(bare_us, 50), "p99": np.percentile(bare_us, 99), "max": bare_us.max(),
        "wire_p50": np.percentile(wire_us, 50), "wire_p99": np.percentile(wire_us, 99),
    }  # fmt: skip


def timer_noise(work_us: float, samples: int = 20_000) -> tuple[float, float]:
    """p50 and p99 (us) of a fixed busy loop of about ``work_us``, timed like `admit`: what
    this machine adds to any measurement (preemption by other processes, mostly)."""
    n, t0 = 0, time.perf_counter_ns()
    while time.perf_counter_ns() - t0 < 200_000_000:  # how many additions make work_us
        sum(range(100))
        n += 1
    loops = max(1, int(work_us / (200_000 / n)))
    times = []
    for _ in range(samples):
        t = time.perf_counter_ns()
        for _ in range(loops):
            sum(range(100))
        times.append(time.perf_counter_ns() - t)
    us = np.array(times) / 1e3
    return float(np.percentile(us, 50)), float(np.percentile(us, 99))


TITLE_ADMIT = "1. Admit-decision latency: 64 instances, 1,000,000 indexed blocks"
FULL_TRACE = {  # section key: (title, prefill, decode, time scale, store blocks)
    "scale1": ("2. Simulator wall time and 3. policy table: full trace, 16 prefill + 16 decode, time scale 1",
               16, 16, 1.0, 50_000),
    "scale05": ("3. Policy table: full trace, 16 prefill + 16 decode, time scale 0.5 (twice the load)",
                16, 16, 0.5, 50_000),
    "nostore": ("Without a store (prefill caches only): 16 prefill + 16 decode, time scale 0.5", 16, 16, 0.5, 0),
    "decodebound": ("Decode-bound: full trace, 16 prefill + 2 decode, time scale 0.5", 16, 2, 0.5, 50_000),
    "slow": ("Workers 1.5x slower than the cost model they report: full trace, 6 prefill + 2 decode, time scale 0.5, "
             "first 3,000 requests", 6, 2, 0.5, 50_000),
}  # fmt: skip
TITLE_SCALE = "Scale: the full trace at 64 and 1,024 instances per role, this checkout against a baseline"
SCALE_RUNS = [  # (prefill = decode instances, store blocks, with the baseline too)
    (64, 50_000, True), (1024, 50_000, True), (64, 0, False), (1024, 0, False),
]
TITLE_SWINGING = "Swinging load: bursts that fill one decode batch while their prefills are in flight"
TITLE_HOT = "Hot prefixes on small caches, no store: 8 prefill + 8 decode"
SECTIONS = ("admit", *FULL_TRACE, "swinging", "hot", "scale")
ADMISSION_POLICIES = ["cache_aware", "cache_aware+early_rejection", "cache_aware+predictive_rejection",
                      "cache_aware+local_prefill+predictive_rejection"]  # fmt: skip


def admit_section() -> list[str]:
    lines = [
        f"## {TITLE_ADMIT}",
        "",
        "48 prefill + 15 decode + 1 store instance; 20,000 admissions of 64-block prompts with cached prefixes "
        "of 0-64 blocks spread over 1-3 prefill caches and the store's DRAM and disk tiers; each request is "
        "settled (first token, end) 512 admissions later, one arriving every 20 ms. `admit` is `Admitter.admit` alone; `wire` adds "
        "decoding the AdmitRequest and encoding the AdmitReply (msgpack). Target: p99 <= 1 ms.",
        "",
        "| policy | admitted | rejected | admit p50 us | admit p99 us | admit max us | CPU p50 us | CPU p99 us "
        "| wire p50 us | wire p99 us |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    p50s = []
    for policy in ("least_loaded", "cache_aware", "cache_aware+replication+predictive_rejection"):
        r = admit_latency(policy)
        p50s.append(r["p50"])
        print(f"admit {policy}: p50 {r['p50']:.0f} us, p99 {r['p99']:.0f} us", file=sys.stderr)
        lines.append(f"| {policy} | {r['admitted']} | {r['rejected']} | {r['p50']:.0f} | {r['p99']:.0f} | "
                     f"{r['max']:.0f} | {r['cpu_p50']:.0f} | {r['cpu_p99']:.0f} | {r['wire_p50']:.0f} | "
                     f"{r['wire_p99']:.0f} |")  # fmt: skip
    noise = timer_noise(max(p50s))
    lines += ["", f"CPU columns: the thread's CPU time (`time.thread_time_ns`), which leaves out time spent "
              f"preempted. The machine's own noise, timed the same way: a fixed busy loop of p50 {noise[0]:.0f} us "
              f"has p99 {noise[1]:.0f} us in the same run (load average at the time: "
              f"{' / '.join(f'{x:.1f}' for x in os.getloadavg())} on 2 cores)."]  # fmt: skip
    return lines


def policy_table(title: str, command: str, about: str, runs: list[tuple[str, SimConfig]], trace) -> list[str]:
    summaries, walls = [], []
    for policy, config in runs:
        started = time.perf_counter()
        summaries.append(summarize(simulate(config, trace)))
        walls.append(time.perf_counter() - started)
        print(f"{title[:20]} {policy}: {walls[-1]:.1f} s", file=sys.stderr)
    return [f"## {title}", "", f"`{command}` ({about})", "", table(summaries, markdown=True), "",
            "Simulator wall time (s): " + ", ".join(f"{p} {w:.1f}" for (p, _), w in zip(runs, walls)) + "."]  # fmt: skip


def full_trace_section(key: str, path: Path) -> list[str]:
    title, num_prefill, num_decode, scale, store_blocks = FULL_TRACE[key]
    slow = key == "slow"
    trace = load_trace(path, scale, max_requests=3_000 if slow else None)
    policies = ADMISSION_POLICIES if slow else POLICIES
    runs = [(p, SimConfig(num_prefill, num_decode, p, store_blocks=store_blocks, slowdown=1.5 if slow else 1.0))
            for p in policies]  # fmt: skip
    command = (f"kvserve simulate --trace {path.name} --prefill {num_prefill} --decode {num_decode} "
               f"--time-scale {scale:g} --store-blocks {store_blocks} --policy {','.join(policies)}")  # fmt: skip
    about = (f"{len(trace)} requests over {trace[-1].arrival_s:.0f} s; SLO TTFT 2 s, TBT 150 ms; seed 0; "
             f"the reference GPU-class cost model{', the simulated workers 1.5x slower than it' if slow else ''}; "
             f"prefill caches of 2,000 blocks, a {store_blocks:,}-block store")  # fmt: skip
    return policy_table(title, command, about, runs, trace)


def swinging_section() -> list[str]:
    trace = swinging()
    policies = ["cache_aware", *ADMISSION_POLICIES[1:]]
    runs = [(p, SimConfig(32, 1, p)) for p in policies]
    about = (f"`services/conductor/simulator/scenarios.py`; {len(trace)} requests: 8 bursts of 120 in 4 s, 40 s "
             f"apart, prompts of 6k-14k tokens, 100-600 output tokens; 32 prefill + 1 decode instance; bench only")
    return policy_table(TITLE_SWINGING, "swinging()", about, runs, trace)


def hot_section() -> list[str]:
    trace = hot_prefix(rate=5.0, prefixes=20)
    policies = ["least_loaded", "cache_aware", "cache_aware+replication"]
    runs = [(p, SimConfig(8, 8, p, store_blocks=0, prefill_cache_blocks=400)) for p in policies]
    about = (f"`services/conductor/simulator/scenarios.py`; {len(trace)} requests at 5 a second, each a 40-block "
             f"document (one of 20, Zipf popularity) and 256-2,048 tokens of its own; prefill caches of 400 blocks, "
             f"no store; bench only")  # fmt: skip
    return policy_table(TITLE_HOT, "hot_prefix(rate=5.0, prefixes=20)", about, runs, trace)


def scale_run(n: int, store_blocks: int, code: Path, trace: Path) -> dict:
    """`bench/conductor_scale.py` in a process of its own, on ``code``'s conductor."""
    command = [sys.executable, str(Path(__file__).with_name("conductor_scale.py")), "--prefill", str(n), "--decode",
               str(n), "--store-blocks", str(store_blocks), "--code", str(code), "--trace", str(trace)]  # fmt: skip
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def scale_section(trace: Path, baseline: Path | None) -> list[str]:
    here = Path(__file__).resolve().parent.parent
    rows, results = [], []
    for n, store_blocks, compare in SCALE_RUNS:
        for name, code in [("baseline", baseline), ("this", here)] if compare and baseline else [("this", here)]:
            r = scale_run(n, store_blocks, code, trace)
            results.append(r)
            print(f"scale {n} store {store_blocks} {name}: {r['wall_s']:.1f} s", file=sys.stderr)
            tiers = r["hit_by_tier"]
            store = tiers.get("dram", 0.0) + tiers.get("disk", 0.0)
            rows.append(f"| {n:,} + {n:,} | {store_blocks:,} | {name} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | "
                        f"{r['admit_cpu_s']:.1f} | {r['admit_p50_us']:.0f} | {r['admit_p99_us']:.0f} | "
                        f"{r['hit']:.1%} | {tiers.get('device', 0.0):.1%} | {store:.1%} | {r['slo_attainment']:.1%} | "
                        f"`{r['decisions']}` |")  # fmt: skip
    return [
        f"## {TITLE_SCALE}", "",
        f"`bench/conductor_scale.py --prefill N --decode N --store-blocks B [--code {baseline or 'DIR'}]` for each "
        f"row, one process each ({trace.name}, time scale 1, policy cache_aware, seed 0; prefill caches of 2,000 "
        f"blocks). `baseline` is the conductor of the checkout at {baseline or '(none given)'}; `this`, this one's. "
        "Wall and CPU: the whole simulation; admit: the thread CPU time of each `Admitter.admit`. Hit rate: "
        "prompt tokens reused, of which from the prefill instance's own cache (device) and from the store "
        "(DRAM). Decisions: a fingerprint of every request's (prefill, decode, copy source, refusal): equal "
        "fingerprints, the same routing.", "",
        "| instances | store blocks | conductor | wall s | CPU s | admit CPU s | admit p50 us | admit p99 us | hit "
        "| own cache | store | SLO att. | decisions |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "", f"Load average at the end: {' / '.join(f'{x:.1f}' for x in os.getloadavg())} on 2 cores.",
    ]  # fmt: skip


def previous_sections(path: Path) -> dict[str, list[str]]:
    """The sections of an earlier run's file, by title (what --sections leaves as it was)."""
    sections: dict[str, list[str]] = {}
    if path.is_file():
        current = None
        for line in path.read_text().splitlines():
            if line.startswith("## "):
                current = sections.setdefault(line[3:], [])
            if current is not None:
                current.append(line)
    for lines in sections.values():
        while lines and not lines[-1]:
            lines.pop()
    return sections


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    root = Path(__file__).resolve().parent.parent
    parser.add_argument("--trace", type=Path, default=root.parent / "shared" / "traces" / "conversation_trace.jsonl")
    parser.add_argument("--out", type=Path, default=root / "bench" / "results" / "conductor.md")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"which to run, of {','.join(SECTIONS)} (default: all); the others are kept as "
                             f"the file has them")  # fmt: skip
    parser.add_argument("--baseline", type=Path, default=None,
                        help="a checkout whose conductor the scale section runs beside this one's")  # fmt: skip
    args = parser.parse_args()
    chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
    if unknown := [s for s in chosen if s not in SECTIONS]:
        parser.error(f"unknown section {unknown[0]!r}; choose from {', '.join(SECTIONS)}")
    old = previous_sections(args.out)
    titles = {"admit": TITLE_ADMIT, **{k: v[0] for k, v in FULL_TRACE.items()}, "swinging": TITLE_SWINGING,
              "hot": TITLE_HOT, "scale": TITLE_SCALE}  # fmt: skip
    lines = [
        "# Conductor benchmark",
        "",
        f"Measured on {platform.machine()}, {platform.python_version()}, a shared 2-core machine (expect +-30% "
        f"between runs); sections last run {datetime.date.today().isoformat()}: {', '.join(chosen)}.",
        "",
        "Command: `.venv/bin/python bench/conductor.py [--sections admit,scale1,...]` (writes this file; sections "
        "not run are kept as they were).",
    ]  # fmt: skip
    for key in SECTIONS:
        if key not in chosen:
            lines += ["", *old.get(titles[key], [f"## {titles[key]}", "", "(not run yet)"])]
        elif key == "admit":
            lines += ["", *admit_section()]
        elif key == "scale":
            lines += ["", *scale_section(args.trace, args.baseline)]
        elif not args.trace.is_file() and key in FULL_TRACE:
            lines += ["", f"## {titles[key]}", "", f"(no trace at {args.trace}: skipped)"]
        elif key in FULL_TRACE:
            lines += ["", *full_trace_section(key, args.trace)]
        else:
            lines += ["", *(swinging_section() if key == "swinging" else hot_section())]
    notes = "Notes on the runs above (by hand)"
    if notes in old:
        lines += ["", *old[notes]]
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
