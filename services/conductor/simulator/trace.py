"""Mooncake-format traces: one JSON object per line with ``timestamp`` (ms),
``input_length``, ``output_length`` and ``hash_ids`` (chained block ids at the
trace's block size, 512 tokens in the FAST'25 release)."""

import json
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK_SIZE = 512


@dataclass(frozen=True)
class TraceRequest:
    index: int
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: str | Path, time_scale: float = 1.0, max_requests: int | None = None,
               start: int = 0) -> list[TraceRequest]:  # fmt: skip
    """Requests ``start`` .. ``start + max_requests`` of the trace, arrivals (made relative to
    the first) multiplied by ``time_scale`` (< 1: the same requests, faster: more load)."""
    if time_scale <= 0:
        raise ValueError(f"the time scale must be positive, got {time_scale}")
    requests: list[TraceRequest] = []
    first = None
    with open(path) as f:
        for i, line in enumerate(f):
            if i < start or not line.strip():
                continue
            if max_requests is not None and len(requests) >= max_requests:
                break
            row = json.loads(line)
            first = row["timestamp"] if first is None else first
            requests.append(TraceRequest(
                index=i, arrival_s=(row["timestamp"] - first) / 1000 * time_scale,
                input_length=int(row["input_length"]), output_length=max(1, int(row["output_length"])),
                hash_ids=tuple(row["hash_ids"]),
            ))  # fmt: skip
    return requests
