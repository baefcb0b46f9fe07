"""Mooncake-format request traces (FAST'25 release): one JSON object a line with
``timestamp`` (ms), ``input_length``, ``output_length`` and ``hash_ids`` (one id
per 512-token block). Reading and checking them; nothing about prompts or timing."""

import json
from dataclasses import dataclass
from pathlib import Path

from libs.protocol.errors import KVServeError

TRACE_BLOCK_TOKENS = 512  # tokens per hash id in the released traces


class TraceError(KVServeError):
    """A trace file that cannot be read or breaks the format."""


@dataclass(frozen=True)
class TraceRequest:
    index: int  # 0-based line number among the trace's requests: the request's identity
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: str | Path, max_requests: int | None = None, start: int = 0) -> list[TraceRequest]:
    """Requests ``start`` .. ``start + max_requests`` of the trace at ``path``, in file order."""
    if start < 0 or (max_requests is not None and max_requests < 1):
        raise ValueError("start must be >= 0 and max_requests >= 1")
    path = Path(path)
    try:
        lines = path.open()
    except OSError as e:
        raise TraceError(f"cannot read trace {path}: {e.strerror}") from None
    requests: list[TraceRequest] = []
    with lines:
        index = 0
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            if index >= start:
                requests.append(_parse(line, index, f"{path}:{lineno}"))
                if max_requests is not None and len(requests) == max_requests:
                    break
            index += 1
    if not requests:
        raise TraceError(f"{path} has no requests from index {start}")
    return requests


def _parse(line: str, index: int, where: str) -> TraceRequest:
    try:
        row = json.loads(line)
        request = TraceRequest(
            index=index,
            timestamp_ms=int(row["timestamp"]),
            input_length=int(row["input_length"]),
            output_length=int(row["output_length"]),
            hash_ids=tuple(int(h) for h in row["hash_ids"]),
        )
    except (ValueError, KeyError, TypeError) as e:
        raise TraceError(f"{where}: not a trace request ({type(e).__name__}: {e})") from None
    if request.timestamp_ms < 0 or request.input_length < 1 or request.output_length < 0:
        raise TraceError(f"{where}: negative timestamp, empty input or negative output length")
    if len(request.hash_ids) != -(-request.input_length // TRACE_BLOCK_TOKENS):
        raise TraceError(
            f"{where}: {len(request.hash_ids)} hash ids for {request.input_length} input tokens "
            f"(expected one per {TRACE_BLOCK_TOKENS}-token block)"
        )
    return request


def arrival_offsets_ms(requests: list[TraceRequest], spread: bool = False) -> dict[int, float]:
    """Each request's arrival, in ms from the window's first, by request index.

    The released traces stamp requests in coarse buckets (the conversation trace:
    about every 3 s, ~10 requests on one timestamp). ``spread`` places the m
    requests of a bucket evenly over the gap to the next distinct timestamp, in
    file order (the last bucket uses the gap before it), so the average rate and
    the order are the trace's but the bucketing's synthetic bursts are not.
    """
    t0 = min(r.timestamp_ms for r in requests)
    if not spread:
        return {r.index: float(r.timestamp_ms - t0) for r in requests}
    buckets: dict[int, list[TraceRequest]] = {}
    for request in sorted(requests, key=lambda r: (r.timestamp_ms, r.index)):
        buckets.setdefault(request.timestamp_ms, []).append(request)
    stamps = sorted(buckets)
    offsets = {}
    for i, stamp in enumerate(stamps):
        if i + 1 < len(stamps):
            gap = stamps[i + 1] - stamp
        else:
            gap = stamp - stamps[i - 1] if i > 0 else 0
        members = buckets[stamp]
        for k, request in enumerate(members):
            offsets[request.index] = stamp - t0 + gap * k / len(members)
    return offsets
