"""Turns bench/transfer.py's measurements into bench/results/transfer.md.

Everything above the ``KEEP`` marker is rewritten on every run; what follows it
(the analysis a person wrote about a run) is kept, so a rerun refreshes the
tables without deleting the explanation — check its date against the tables'.
"""

import datetime
import math
import os
import statistics
import subprocess
from pathlib import Path

import torch

KEEP = "<!-- Everything below this line is written by hand and kept when the bench reruns. -->"
SHM_TARGET = TCP_TARGET = 0.8
TLS_TARGET = 0.25  # the most TLS may cost of TCP's throughput at >= 4 MiB
TARGET_FROM = 4 << 20


def machine_load() -> dict:
    """The load average and the processes (not ours) using a noticeable share of a core."""
    load = Path("/proc/loadavg").read_text().split()[:3]
    ours = {os.getpid(), os.getppid()}
    busy = []
    try:
        ps = subprocess.run(["ps", "-eo", "pid,ppid,pcpu,comm", "--sort=-pcpu"], capture_output=True, text=True).stdout
        for line in ps.splitlines()[1:]:
            pid, ppid, cpu, comm = line.split(None, 3)
            if float(cpu) >= 5 and int(pid) not in ours and int(ppid) not in ours:
                busy.append(f"{comm} {float(cpu):.0f}%")
    except (OSError, ValueError):
        pass
    return {"load": " ".join(load), "busy": busy[:6]}


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def size_label(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def gbps(n: int, samples: list[float]) -> float:
    return n / statistics.median(samples) / 1e9


def cell(n: int, samples: list[float] | None) -> str:
    """Median GB/s and the spread of the repetitions: half the interquartile range, in % of the median."""
    if not samples:
        return "—"
    median = statistics.median(samples)
    if len(samples) < 4:
        return f"{n / median / 1e9:.2f}"
    q1, _, q3 = statistics.quantiles(samples, n=4)
    return f"{n / median / 1e9:.2f} ±{(q3 - q1) / 2 / median * 100:.0f}%"


def best_memcpy(n: int, s: dict[str, list[float]]) -> float:
    """The faster of torch's copy_ with its default threads and with one (GB/s)."""
    return max(gbps(n, s["memcpy"]), gbps(n, s["memcpy-1t"]))


def ratio(a: float, b: float) -> str:
    return f"{a / b * 100:.0f}%"


def wire_tables(wire: dict[int, dict[str, list[float]]]) -> list[str]:
    has_mooncake = any("mooncake" in s for s in wire.values())
    lines = ["## Shared memory: our shm path vs a memory copy", "",
             "GB/s (10^9 bytes/s), median of the repetitions ± half their interquartile range (% of the median). `ours` = `await engine.write(ticket, "
             "src, [Span(0, 0, n)])` with transport=\"shm\", a fresh ticket per transfer; receiver in another process "
             "unless marked in-process.", "",
             f"| size | memcpy: torch `copy_`, {torch.get_num_threads()} threads | memcpy: `copy_`, 1 thread "
             "| ours shm, receiver process | % of best memcpy | ours shm, in-process | % of best memcpy |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for n, s in wire.items():
        copy = best_memcpy(n, s)
        lines.append(f"| {size_label(n)} | {cell(n, s['memcpy'])} | {cell(n, s['memcpy-1t'])} | {cell(n, s['shm'])} "
                     f"| {ratio(gbps(n, s['shm']), copy)} | {cell(n, s['shm-local'])} "
                     f"| {ratio(gbps(n, s['shm-local']), copy)} |")  # fmt: skip
    header = "| size | bare socket | ours tcp ×1 | ours tcp ×4 (default) | ×4 % of socket | ours tcp ×8 |"
    rule = "|---|---|---|---|---|---|"
    if has_mooncake:
        header += " Mooncake sync write | Mooncake batch (4 MiB slices) | ours ×4 / best Mooncake |"
        rule += "---|---|---|"
    lines += ["", "## TCP on loopback: ours vs a bare socket and Mooncake", "",
              "Receivers in other processes on 127.0.0.1. Bare socket: one persistent connection, `sendall` of a "
              "length then the bytes from a preallocated buffer, `recv_into` a preallocated buffer, one ack byte back. "
              "Ours: a fresh ticket per transfer, so every transfer pays its token greeting and final status, on "
              "connections reused from the idle pool (as in the service); 4 MiB slices over up to 1, 4 or 8 "
              "connections, opened as the slices need them.", "", header, rule]  # fmt: skip
    for n, s in wire.items():
        row = (f"| {size_label(n)} | {cell(n, s['socket'])} | {cell(n, s['tcp1'])} | {cell(n, s['tcp4'])} "
               f"| {ratio(gbps(n, s['tcp4']), gbps(n, s['socket']))} | {cell(n, s['tcp8'])} |")  # fmt: skip
        if has_mooncake:
            best = max(gbps(n, s["mooncake"]), gbps(n, s["mooncake-batch"]))
            row += f" {cell(n, s['mooncake'])} | {cell(n, s['mooncake-batch'])} | {gbps(n, s['tcp4']) / best:.2f}x |"
        lines.append(row)
    if all("tls4" in s for s in wire.values()):
        lines += ["", "## TCP with mutual TLS vs in clear", "",
                  "The same path and receiver process, its listener with TLS 1.3 (`KVSERVE_TRANSFER_TLS_*`, a "
                  "throwaway CA): each connection's TLS session authenticates both ends and agrees its keys, then "
                  "its bytes travel in 1 MiB AES-256-GCM records that `cryptography` seals "
                  "(`libs/transfer/tcp/sealed.py`). Connections are pooled, so the handshake is paid once per "
                  "connection, not per transfer. Cost = 1 - TLS / clear. The bare socket with TLS throughout "
                  "(Python's `ssl` module and the system's OpenSSL, TLS's own 16 KiB records, one persistent "
                  "connection) against the bare socket in clear is what TLS costs without the sealed records.", "",
                  "| size | bare socket | bare socket TLS | cost, bare | clear ×1 | TLS ×1 | cost ×1 "
                  "| clear ×4 (default) | TLS ×4 | cost ×4 |",
                  "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for n, s in wire.items():
            bare = (f"| {cell(n, s['socket'])} | {cell(n, s['socket-tls'])} | "
                    f"{(1 - gbps(n, s['socket-tls']) / gbps(n, s['socket'])) * 100:.0f}% " if "socket-tls" in s
                    else "| – | – | – ")  # fmt: skip
            lines.append(f"| {size_label(n)} {bare}| {cell(n, s['tcp1'])} | {cell(n, s['tls1'])} "
                         f"| {tls_cost(n, s, 1)} | {cell(n, s['tcp4'])} | {cell(n, s['tls4'])} | {tls_cost(n, s, 4)} |")  # fmt: skip
    small = [n for n in wire if n <= 1 << 20]
    if small:
        names = list(next(iter(wire.values())))
        lines += ["", "Time per transfer (µs, median) at the small sizes:", "",
                  "| size | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]  # fmt: skip
        for n in small:
            lines.append(f"| {size_label(n)} | " + " | ".join(f"{statistics.median(wire[n][m]) * 1e6:.0f}" for m in names) + " |")
    return lines


def pair_costs(p: dict) -> tuple[float, float, float]:
    """The median of the pairs' costs (1 - clear seconds / TLS seconds) and its 95% confidence
    interval, from the order statistics (no assumption about the costs' distribution)."""
    costs = sorted(1 - clear / tls for clear, tls in p["pairs"])
    n = len(costs)
    half = 1.96 * math.sqrt(n) / 2
    low, high = math.floor(n / 2 - half), math.ceil(n / 2 + half)  # ranks, from 1
    low, high = max(0, low - 1), min(n - 1, high - 1)
    return statistics.median(costs), costs[low], costs[high]


def tls_pairs_table(pairs: list[dict], flush_bytes: int) -> list[str]:
    if not pairs:
        return []
    lines = ["", "## TLS side by side", "",
             "Clear ×4 and TLS ×4 alone, one transfer each, back to back (which goes first alternates), as many "
             "pairs as fit about 2 s a size and condition (`--tls-pairs`): far more samples than the table's "
             "repetitions, both contenders under the same conditions. Warm: transfers back to back. Cold: before "
             f"each transfer a {size_label(flush_bytes)} memory copy evicts the caches, as a model's forward does "
             "between a worker's transfers. A pair's cost = 1 − clear seconds / TLS seconds; the median of the "
             "pairs, with its 95% confidence interval (order statistics).", "",
             "| size | caches | pairs | clear ×4 GB/s | TLS ×4 GB/s | cost: median of pairs [95% CI] |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for p in pairs:
        n, clear, tls = p["size"], [c for c, _ in p["pairs"]], [t for _, t in p["pairs"]]
        median, low, high = pair_costs(p)
        lines.append(f"| {size_label(n)} | {'cold' if p['cold'] else 'warm'} | {len(clear)} | {cell(n, clear)} "
                     f"| {cell(n, tls)} | {median * 100:.0f}% [{low * 100:.0f}, {high * 100:.0f}] |")
    return lines


def tls_cost(n: int, s: dict[str, list[float]], connections: int) -> str:
    return f"{(1 - gbps(n, s[f'tls{connections}']) / gbps(n, s[f'tcp{connections}'])) * 100:.0f}%"


def target_lines(wire: dict[int, dict[str, list[float]]], pairs: list[dict]) -> list[str]:
    big = [n for n in wire if n >= TARGET_FROM]
    if not big:
        return []
    lines = ["", "## Targets (sizes >= 4 MiB)", ""]
    for label, ours, base, target in (("shm >= 80% of the best memcpy", "shm", best_memcpy, SHM_TARGET),
                                      ("TCP (4 connections) >= 80% of the bare socket", "tcp4",
                                       lambda n, s: gbps(n, s["socket"]), TCP_TARGET)):  # fmt: skip
        shares = {n: gbps(n, wire[n][ours]) / base(n, wire[n]) for n in big}
        missed = [size_label(n) for n, share in shares.items() if share < target]
        detail = ", ".join(f"{size_label(n)} {share * 100:.0f}%" for n, share in shares.items())
        lines.append(f"- {label}: {'met' if not missed else 'NOT met at ' + ', '.join(missed)} ({detail})")
    if pairs:  # judged on the side-by-side pairs: many samples, both conditions
        medians = [(p, pair_costs(p)[0]) for p in pairs]
        over = sorted({size_label(p["size"]) for p, cost in medians if cost > TLS_TARGET})
        detail = ", ".join(f"{size_label(p['size'])} {'cold' if p['cold'] else 'warm'} {cost * 100:.0f}%"
                           for p, cost in medians)  # fmt: skip
        lines.append(f"- TLS costs <= {TLS_TARGET * 100:.0f}% of TCP's throughput (4 connections), median of the "
                     f"side-by-side pairs: {'met' if not over else 'NOT met at ' + ', '.join(over)} ({detail})")
    if all("tls4" in wire[n] for n in big):
        costs = {n: 1 - gbps(n, wire[n]["tls4"]) / gbps(n, wire[n]["tcp4"]) for n in big}
        over = [size_label(n) for n, cost in costs.items() if cost > TLS_TARGET]
        detail = ", ".join(f"{size_label(n)} {cost * 100:.0f}%" for n, cost in costs.items())
        reps = len(wire[big[0]]["tls4"])
        lines.append(f"- the same, from the repetitions of the TLS table (every contender in turn, {reps} transfers a "
                     f"size): {'within' if not over else 'over at ' + ', '.join(over)} ({detail})")  # fmt: skip
    if all("mooncake" in wire[n] for n in big):
        shares = {n: gbps(n, wire[n]["tcp4"]) / max(gbps(n, wire[n]["mooncake"]), gbps(n, wire[n]["mooncake-batch"]))
                  for n in wire}  # fmt: skip
        behind = [size_label(n) for n, share in shares.items() if share < 1]
        detail = ", ".join(f"{size_label(n)} {share:.2f}x" for n, share in shares.items())
        lines.append(f"- TCP ahead of Mooncake's TCP transport (best of its two APIs), every size: "
                     f"{'met' if not behind else 'NOT met at ' + ', '.join(behind)} ({detail})")  # fmt: skip
    return lines


def handoff_table(handoff: list[dict]) -> list[str]:
    if not handoff:
        return []
    lines = ["", "## KV hand-off of a 2,048-token SmolLM2 prompt, receiver in another process", "",
             "(a) prefill alone; (b) prefill, then every block shipped whole (`transfer` = from the end of the prefill "
             "to the last byte acknowledged); (c) layer-wise: the writer is opened before the prefill and each layer's "
             "128 block ranges (one per block) are submitted from `layer_done`. Medians; (b) and (c) run back to back "
             "in every repetition, so the differences are taken per repetition (paired) and then the median.", "",
             "- hidden = (b − c) / transfer: how much of the transfer the overlap takes off the end-to-end time. It "
             "is the difference of two multi-second prefills, so machine noise of a few % of the prefill swamps it; "
             "see the exposed tail for a figure noise does not move much.",
             "- exposed tail: in (c), from the end of the prefill to the last byte acknowledged — the part of the "
             "transfer the overlap did not hide; tail-hidden = 1 − tail / transfer.",
             "",
             "| dtype | max chunk | KV bytes | transport | (a) prefill s | transfer after (b) | (b) e2e s | (c) e2e s "
             "| hidden (b−c)/transfer | (c) exposed tail | tail-hidden |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for h in handoff:
        s = h["samples"]
        prefill = statistics.median(r["prefill"] for r in s["prefill"])
        for t in ("shm", "tcp"):
            b, c = s[f"serial-{t}"], s[f"layerwise-{t}"]
            transfer = statistics.median(r["transfer"] for r in b)
            saved = statistics.median(rb["e2e"] - rc["e2e"] for rb, rc in zip(b, c))
            tail = statistics.median(r["tail"] for r in c)
            lines.append(f"| {h['dtype']} | {h['chunk']} | {h['kv_bytes'] / 1e6:.1f} MB | {t} | {prefill:.2f} "
                         f"| {transfer * 1e3:.1f} ms ({h['kv_bytes'] / transfer / 1e9:.2f} GB/s) "
                         f"| {statistics.median(r['e2e'] for r in b):.2f} | {statistics.median(r['e2e'] for r in c):.2f} "
                         f"| {saved / transfer * 100:.0f}% | {tail * 1e3:.1f} ms | {(1 - tail / transfer) * 100:.0f}% |")
    return lines


def report(result: dict, command: str, started: datetime.datetime, before: dict, after: dict) -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    lines = [
        "# Transfer benchmark: our transfer engine vs memory copy, bare sockets and Mooncake",
        "",
        f"- command: `{command}`",
        f"- date: {started.strftime('%Y-%m-%d %H:%M')} (took {(datetime.datetime.now() - started).seconds} s)",
        f"- machine: {cpu_model()}, {os.cpu_count()} cores, {mem / 2**30:.0f} GiB RAM, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads)",
        f"- load average before: {before['load']}; after: {after['load']}",
        f"- other work running before: {', '.join(before['busy']) or 'none above 5% of a core'}; "
        f"after: {', '.join(after['busy']) or 'none above 5% of a core'}",
        f"- Mooncake Transfer Engine: {result['mooncake']}"
        + (f"; its sync write returned before the bytes were at the target at {', '.join(size_label(n) for n in result['mooncake_late'])}"
           if result["mooncake_late"] else ""),  # fmt: skip
        "- every contender's bytes were checked once per size (hash of the destination after a write into a "
        "zeroed buffer), outside the timed runs; repetitions alternate between contenders",
        "",
    ]
    lines += wire_tables(result["wire"])
    lines += tls_pairs_table(result.get("tls_pairs", []), result.get("flush_bytes", 0))
    lines += target_lines(result["wire"], result.get("tls_pairs", []))
    lines += ["", "## Where a small transfer's fixed cost goes", "",
              "Each piece our writers put on every transfer, timed alone in this process (median µs):", "",
              "| piece | µs |", "|---|---|"]  # fmt: skip
    lines += [f"| {what} | {us:.0f} |" for what, us in result["costs"]]
    lines += handoff_table(result["handoff"])
    return "\n".join(lines) + "\n"


def write_report(path: Path, text: str) -> None:
    """Write the generated part, keeping the hand-written part of an earlier version."""
    kept = ""
    if path.exists():
        old = path.read_text()
        if KEEP in old:
            kept = old[old.index(KEEP) :]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n" + (kept or KEEP + "\n"))
