"""A transfer listener holds a bounded number of connections, closes idle ones, and
spends no thread on a connection that is not transferring."""

import select
import socket
import threading
from contextlib import ExitStack

import pytest

from libs.transfer import Span, TransferEngine, TransferError
from libs.transfer.tcp.listener import TcpListener
from libs.transfer.tcp.wire import FRAME, Status, greeting
from tests.integration.conftest import wait_until

KiB = 1 << 10


def listener_of(engine: TransferEngine) -> TcpListener:
    return engine.transports["tcp"].listener


def listening(segments, **settings):
    engine = segments.engine("host-a", listen="127.0.0.1:0", transport="tcp", **settings)
    return engine, segments.segment(engine, 64 * KiB)


def connections(stack: ExitStack, address: str, n: int) -> list[socket.socket]:
    host, port = address.rsplit(":", 1)
    return [stack.enter_context(socket.create_connection((host, int(port)), timeout=10)) for _ in range(n)]


def readable(sock: socket.socket) -> bool:
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


async def test_connections_over_the_cap_are_closed_at_once_and_counted(segments):
    engine, dst = listening(segments, max_connections=4)
    sender = segments.engine("host-b", transport="tcp")
    src = segments.segment(sender, 64 * KiB)
    src.tensor.fill_(5)
    refused = engine.metrics.refused.value("too_many_connections")
    with ExitStack() as stack:
        socks = connections(stack, listener_of(engine).address, 10)
        wait_until(lambda: sum(map(readable, socks)) == 6, timeout=10)
        turned_away = [s for s in socks if readable(s)]
        assert all(s.recv(2) == bytes([Status.BUSY]) for s in turned_away)  # told why, then closed
        assert all(s.recv(1) == b"" for s in turned_away)
        assert listener_of(engine).open_connections == 4 and listener_of(engine).refused_connections == 6
        assert engine.metrics.refused.value("too_many_connections") == refused + 6

        ticket = engine.expect(dst.name, [(0, KiB)], ttl=30)
        with pytest.raises(TransferError) as caught:  # the four idle ones hold every place
            await sender.write(ticket, src.name, [Span(0, 0, KiB)], timeout=10)
        assert caught.value.cause == "peer_gone"
        assert dst.tensor.count_nonzero() == 0
    wait_until(lambda: listener_of(engine).open_connections == 0, timeout=10)  # ours are closed: places free again
    ticket = engine.expect(dst.name, [(0, KiB)], ttl=30)
    await sender.write(ticket, src.name, [Span(0, 0, KiB)], timeout=10)
    assert dst.tensor[:KiB].eq(5).all()


def test_idle_connections_are_closed(segments):
    engine, dst = listening(segments, idle_timeout=0.2)
    closed = engine.metrics.idle_closed.value()
    with ExitStack() as stack:
        silent = connections(stack, listener_of(engine).address, 3)
        stalled = connections(stack, listener_of(engine).address, 1)[0]  # greets, starts a frame, then stops
        ticket = engine.expect(dst.name, [(0, KiB)], ttl=60)
        stalled.sendall(greeting(ticket.token, nonce=1))
        assert stalled.recv(1) == bytes([Status.OK])
        stalled.sendall(FRAME.pack(0, KiB) + b"s" * 10)
        wait_until(lambda: listener_of(engine).open_connections == 0, timeout=30)
        assert all(s.recv(1) == b"" for s in silent)
        assert stalled.recv(1) == bytes([Status.FAILED])
    assert engine.metrics.idle_closed.value() == closed + 3
    assert engine.close_ticket(ticket.token).failed == "timeout"


def test_many_idle_connections_take_no_threads(segments):
    engine, _ = listening(segments, max_connections=500)
    before = threading.active_count()
    with ExitStack() as stack:
        connections(stack, listener_of(engine).address, 200)
        wait_until(lambda: listener_of(engine).open_connections == 200, timeout=30)
        assert threading.active_count() <= before + 2  # not one per connection
