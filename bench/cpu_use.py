"""Where the CPU went while bench/replay.py measured a configuration: its
processes' CPU seconds and the whole machine's (from /proc), and py-spy profiles
of every kvserve service with their top frames."""

import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path


def start_profiles(pids: dict[str, int], seconds: int, out: Path, prefix: str) -> list[subprocess.Popen]:
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    procs = []
    for instance, pid in pids.items():
        path = out / f"profile-{prefix}-{instance}.txt"
        cmd = [py_spy, "record", "-p", str(pid), "-d", str(seconds), "-r", "20", "-f", "raw", "-o", str(path)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return procs


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (all its threads)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy (not idle or waiting on I/O), all cores."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def cpu_line(name: str, before: dict[str, float], after: dict[str, float], wall: float) -> str:
    """Where the CPU went during a configuration's sweep: its processes, and everyone else."""
    used = {k: after[k] - before.get(k, 0.0) for k in after if k != "machine"}
    ours = sum(used.values())
    machine = after["machine"] - before["machine"]
    parts = ", ".join(f"{k} {v:.0f}" for k, v in sorted(used.items(), key=lambda kv: -kv[1]))
    return (f"- {name}: {wall:.0f} s wall, machine busy {machine:.0f} CPU-s of {wall * os.cpu_count():.0f}; "
            f"this configuration {ours:.0f} ({parts}); everything else {machine - ours:.0f}")  # fmt: skip


def top_frames(path: Path, n: int = 12) -> list[tuple[str, float]]:
    """Self time by function from a py-spy raw (collapsed) profile: (frame, share of samples)."""
    self_time: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        leaf = stack.split(";")[-1]
        self_time[leaf] += int(count)
        total += int(count)
    return [(frame, c / total) for frame, c in self_time.most_common(n)] if total else []
