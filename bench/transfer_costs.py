"""Where a small transfer's fixed cost goes, for bench/transfer.py: the pieces
our writers put on every transfer, each timed alone (median of many runs).

A writer hands its work to a pooled thread (or, for a small shm copy with
nothing queued, copies on the caller's thread) and ``finish()`` waits on a
future the last lane resolves. A TCP lane takes an idle connection to the same
receiver from the pool when there is one (else dials), presents the transfer's
token, sends its frames and waits for the receiver's final status byte. None of
this depends on the transfer's size.
"""

import asyncio
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import msgspec
import torch

from libs.protocol.schema import WriteTicket
from libs.transfer import SharedSegment, Span
from libs.transfer.tcp.connection import IdleConnections, TcpConnection
from libs.transfer.writers import MAX_LANE_THREADS

SMALL = 64 << 10
_POOL = ThreadPoolExecutor(max_workers=MAX_LANE_THREADS, thread_name_prefix="kv-writer")  # as a TransferEngine's


def _median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def _time(fn: Callable[[], object], k: int) -> float:
    samples = []
    for _ in range(k):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return _median_us(samples)


async def fixed_costs(peer, source: SharedSegment, k: int = 200) -> list[tuple[str, float]]:
    """(what, µs) for each piece of a transfer's fixed cost."""
    src, dst = torch.ones(SMALL, dtype=torch.uint8), torch.zeros(SMALL, dtype=torch.uint8)
    handoff = []
    for _ in range(k):
        start = time.perf_counter()
        await asyncio.wrap_future(_POOL.submit(lambda: None))
        handoff.append(time.perf_counter() - start)
    rows = [
        ("hand an empty job to the writers' thread pool and await it from the event loop", _median_us(handoff)),
        ("torch `copy_` of 64 KiB on the calling thread", _time(lambda: dst.copy_(src), k)),
        ("the same `copy_` on a pooled thread", _time(lambda: _POOL.submit(lambda: dst.copy_(src)).result(), k)),
    ]
    rows += _tcp_rows(peer, source, k // 4, IdleConnections(), "a new connection (dial + token greeting)")
    pool = IdleConnections()
    _tcp_rows(peer, source, 1, pool, "warm-up")  # one transfer, so the next ones find its connection idle
    rows += _tcp_rows(peer, source, k // 4, pool, "a pooled connection (token greeting only)")
    return rows


def _tcp_rows(peer, source: SharedSegment, k: int, pool: IdleConnections, what: str) -> list[tuple[str, float]]:
    connect, send, end = [], [], []
    for wire in peer.ask("tickets", k)["tickets"]:
        ticket = msgspec.convert(wire, WriteTicket)
        start = time.perf_counter()
        connection = TcpConnection(ticket.address, ticket.token, time.monotonic() + 30, pool=pool)
        connected = time.perf_counter()
        connection.send(source.view, [Span(0, 0, SMALL)])
        sent = time.perf_counter()
        connection.finish()
        connect.append(connected - start), send.append(sent - connected), end.append(time.perf_counter() - sent)
    return [
        (f"TCP, {what}, no threads", _median_us(connect)),
        ("  then one 64 KiB frame (`sendmsg`)", _median_us(send)),
        ("  then the end frame and the receiver's final status byte", _median_us(end)),
    ]
