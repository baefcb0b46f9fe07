"""Mooncake-format traces: one JSON object per line with ``timestamp`` (ms),
``input_length``, ``output_length`` and ``hash_ids`` (chained block ids at the
trace's block size, 512 tokens in the FAST'25 release); optionally ``tenant``,
``weight`` and ``cache_scope``, as in a tenants file. A tenant's block ids are
renamed into its cache scope (its own, or the shared one it names), as the
gateway's scope roots rename its block hashes: no other tenant's can match them."""

import hashlib
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
    tenant: str | None = None
    weight: float = 1.0  # its tenant's weight


def scoped_ids(hash_ids: tuple[int, ...], scope: str) -> tuple[int, ...]:
    """``hash_ids`` renamed into cache scope ``scope`` (deterministically)."""
    return tuple(int.from_bytes(hashlib.blake2b(f"{scope}/{h}".encode(), digest_size=8).digest(), "little")
                 for h in hash_ids)  # fmt: skip


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
            tenant, shared = row.get("tenant"), row.get("cache_scope")
            hash_ids = tuple(row["hash_ids"])
            if shared is not None:
                hash_ids = scoped_ids(hash_ids, f"shared/{shared}")
            elif tenant is not None:
                hash_ids = scoped_ids(hash_ids, f"tenant/{tenant}")
            requests.append(TraceRequest(
                index=i, arrival_s=(row["timestamp"] - first) / 1000 * time_scale,
                input_length=int(row["input_length"]), output_length=max(1, int(row["output_length"])),
                hash_ids=hash_ids,
                tenant=tenant, weight=float(row.get("weight", 1.0)),
            ))  # fmt: skip
    return requests
