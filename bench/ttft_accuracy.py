"""How far kvserve's predicted TTFT is from the measured one, per prompt-size band.

Reads the run files `bench/replay.py --out DIR` wrote for kvserve-default (one JSON
file per time scale), where each admitted request keeps the TTFT the conductor
predicted for it (`x-kvserve-predicted-ttft-ms`: the cost model's prediction with its
queue, before the learned slack) beside the one measured, and prints, per run and
band, the measured/predicted ratio (p10, p50, p90) and the difference (p50, p90).

    python bench/ttft_accuracy.py DIR [--label kvserve-default]
"""

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvserve.replay.metrics import BANDS, band_of  # noqa: E402
from kvserve.replay.records import Run  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="a bench/replay.py --out folder")
    parser.add_argument("--label", default="kvserve-default", help="whose run files to read (default kvserve-default)")
    args = parser.parse_args()
    paths = sorted(args.out.glob(f"{args.label}-x*.json"))
    if not paths:
        raise SystemExit(f"no {args.label}-x*.json in {args.out}")
    print("| offered req/s | prompt tokens | admitted | measured / predicted p10 / p50 / p90 "
          "| measured - predicted p50 / p90 ms |")
    print("|---:|---|---:|---|---|")
    for path in paths:
        run = Run.load(path)
        for band in BANDS:
            pairs = np.array([(r.ttft_s, r.predicted_ttft_s) for r in run.records
                              if band_of(r.input_tokens) == band and r.ttft_s is not None and r.predicted_ttft_s])
            if not len(pairs):
                continue
            ratio, diff = pairs[:, 0] / pairs[:, 1], (pairs[:, 0] - pairs[:, 1]) * 1e3
            print(f"| {run.offered_rps:.2f} | {band} | {len(pairs)} | "
                  + " / ".join(f"{np.percentile(ratio, q):.2f}" for q in (10, 50, 90))
                  + f" | {np.percentile(diff, 50):.0f} / {np.percentile(diff, 90):.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
