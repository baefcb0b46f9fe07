"""The first seconds of a cluster: TTFT of one request at a time, from the moment
`LocalCluster.start()` returns (when `kvserve up` prints its URL), for three start-ups:
the default (start() waits for the first warm spares to load), the spares loading beside
the first requests (``spares_before_ready=False``, as before that wait), and no spares.

Each request is a fresh ~110-token prompt (no cache hit), `max_tokens` 2; a new
cluster per variant, the same prompt lengths, other words. Reports the start-up time
and TTFT's median over the first 5 s and over the rest.

    .venv/bin/python bench/first_seconds.py [--requests 40] [--out bench/results/first-seconds.md]
"""

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvserve.cli.cluster import LocalCluster  # noqa: E402

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches near old "
         "towns and rivers").split()  # fmt: skip
EARLY_S = 5.0
VARIANTS = (  # (name, LocalCluster arguments)
    ("default: spares loaded before the URL", {}),
    ("spares loading beside the first requests", {"spares_before_ready": False}),
    ("no spares (--no-standby)", {"standby": False}),
)


def ttft(url: str, model: str, prompt: str) -> float:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 2, "stream": True}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=60) as response:
        for line in response:
            if line.startswith(b"data:"):
                first = time.perf_counter() - start
                for _ in response:  # read to the end
                    pass
                return first
    raise RuntimeError("no token came back")


def run(name: str, kwargs: dict, requests: int, seed: int, log) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvserve-first-seconds-") as stores:
        cluster = LocalCluster(prefill=1, decode=1, gateway_port=0, log=log, supervise=True, store_dir=stores, **kwargs)
        began = time.monotonic()
        cluster.start(timeout=180)
        started = time.monotonic()
        try:
            rng = random.Random(seed)
            samples = []
            for i in range(requests):
                prompt = f"{seed}-{i} " + " ".join(rng.choice(WORDS) for _ in range(95))
                at = time.monotonic() - started
                samples.append((at, ttft(cluster.gateway_url, cluster.model_id, prompt)))
        finally:
            cluster.stop()
    early = [t for at, t in samples if at < EARLY_S]
    late = [t for at, t in samples if at >= EARLY_S]
    out = {"name": name, "start_s": started - began, "early": early, "late": late}
    print(f"{name}: start {out['start_s']:.1f} s; TTFT median first {EARLY_S:g} s "
          f"{statistics.median(early) * 1e3:.0f} ms ({len(early)}), after {statistics.median(late) * 1e3:.0f} ms "
          f"({len(late)})", flush=True)  # fmt: skip
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--log", type=Path, default=Path(os.devnull), help="the clusters' output")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    with args.log.open("a") as log:
        results = [run(name, kwargs, args.requests, 1000 * (i + 1), log) for i, (name, kwargs) in enumerate(VARIANTS)]
    load = os.getloadavg()
    lines = [
        "# The first seconds after the URL",
        "",
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC on {platform.node()}, "
        f"{os.cpu_count()} CPUs, load average at the end {load[0]:.2f}.",
        "",
        f"Command: `.venv/bin/python {' '.join(sys.argv)}`",
        "",
        f"One cluster per variant (1 prefill + 1 decode worker, store, defaults otherwise); {args.requests} requests, "
        "one at a time, each a fresh ~110-token prompt with `max_tokens` 2, from the moment the cluster's start "
        "returned (when `kvserve up` prints its URL).",
        "",
        f"| start-up | start to URL s | TTFT median, first {EARLY_S:g} s (n) | TTFT median, after (n) "
        "| first / after |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in results:
        early, late = statistics.median(r["early"]), statistics.median(r["late"])
        lines.append(f"| {r['name']} | {r['start_s']:.1f} | {early * 1e3:.0f} ms ({len(r['early'])}) | "
                     f"{late * 1e3:.0f} ms ({len(r['late'])}) | {early / late:.2f}x |")  # fmt: skip
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
