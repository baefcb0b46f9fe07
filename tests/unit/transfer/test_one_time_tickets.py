"""Over real sockets: a sniffed greeting replayed writes nothing, a range is written
once, a ticket used over shared memory is dead over TCP, and a process whose peers
are all on its host listens on no port."""

import logging
import socket

import pytest
import torch

from libs.transfer import Span, TransferError
from libs.transfer.tcp.wire import END_OFFSET, FRAME, Status, greeting
from tests.unit.transfer.proc_net import listening_ports

KiB = 1 << 10


@pytest.fixture
def receiver(segments):
    engine = segments.engine("host-a", listen="127.0.0.1:0")
    return engine, segments.segment(engine, 64 * KiB)


def sender(segments, host: str = "host-b", transport: str = "tcp", fill: int = 7, **settings):
    engine = segments.engine(host, transport=transport, **settings)
    src = segments.segment(engine, 64 * KiB)
    src.tensor.fill_(fill)
    return engine, src


def connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def closed(sock: socket.socket) -> bool:
    """The receiver closed the connection (a reset when it left our bytes unread)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_a_replayed_greeting_is_refused_logged_and_writes_nothing(receiver, caplog):
    engine, dst = receiver
    ticket = engine.expect(dst.name, [(0, 2 * KiB)], ttl=30)
    sniffed = greeting(ticket.token, nonce=41)
    with connect(ticket.address) as sock:  # the sender's transfer, as seen on the wire
        sock.sendall(sniffed)
        assert sock.recv(1) == bytes([Status.OK])
        sock.sendall(FRAME.pack(0, KiB) + b"a" * KiB + FRAME.pack(END_OFFSET, 0))
        assert sock.recv(1) == bytes([Status.OK])
    replays = engine.metrics.refused.value("replayed")
    with caplog.at_level(logging.WARNING, logger="libs.transfer.tcp.listener"), connect(ticket.address) as sock:
        sock.sendall(sniffed + FRAME.pack(KiB, KiB) + b"x" * KiB)  # the same greeting, then bytes for the rest
        assert sock.recv(1) == bytes([Status.REFUSED])
        assert closed(sock)
    record = engine.close_ticket(ticket.token)
    assert record.bytes_received == KiB
    assert bytes(dst.tensor[:KiB].tolist()) == b"a" * KiB and dst.tensor[KiB:].count_nonzero() == 0
    assert engine.metrics.refused.value("replayed") == replays + 1
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 1 and "replayed" in refusals[0]
    assert all(ticket.token not in r.getMessage() for r in caplog.records)  # the token is never logged


async def test_a_range_already_written_is_refused_and_keeps_its_bytes(receiver, segments):
    engine, dst = receiver
    tx, src = sender(segments)
    ticket = engine.expect(dst.name, [(0, 4 * KiB)], ttl=30)
    await tx.write(ticket, src.name, [Span(0, 0, 2 * KiB)])
    src.tensor.fill_(9)
    for overlap in (Span(0, 0, 2 * KiB), Span(KiB, KiB, 2 * KiB)):
        with pytest.raises(TransferError) as caught:
            await tx.write(ticket, src.name, [overlap])
        assert caught.value.cause == "bad_range"
    assert dst.tensor[: 2 * KiB].eq(7).all() and dst.tensor[2 * KiB :].count_nonzero() == 0
    await tx.write(ticket, src.name, [Span(2 * KiB, 2 * KiB, 2 * KiB)])  # the part never written: once
    assert dst.tensor[2 * KiB : 4 * KiB].eq(9).all()


def test_a_frame_over_bytes_its_own_connection_wrote_is_refused(receiver):
    engine, dst = receiver
    ticket = engine.expect(dst.name, [(0, 4 * KiB)], ttl=30)
    with connect(ticket.address) as sock:
        sock.sendall(greeting(ticket.token, nonce=1))
        assert sock.recv(1) == bytes([Status.OK])
        sock.sendall(FRAME.pack(0, KiB) + b"a" * KiB + FRAME.pack(KiB // 2, KiB) + b"x" * KiB)
        assert sock.recv(1) == bytes([Status.BAD_FRAME])
        assert closed(sock)
    assert bytes(dst.tensor[:KiB].tolist()) == b"a" * KiB and dst.tensor[KiB:].count_nonzero() == 0


async def test_slices_of_one_ticket_still_go_over_several_connections(receiver, segments):
    engine, dst = receiver
    tx, src = sender(segments, connections=4, slice_bytes=8 * KiB)
    ticket = engine.expect(dst.name, [(0, 32 * KiB)], ttl=30)
    await tx.write(ticket, src.name, [Span(0, 0, 32 * KiB)])
    assert engine.transports["tcp"].listener.accepted == 4  # one greeting each, each with its own nonce
    assert dst.tensor[: 32 * KiB].eq(7).all()


async def test_a_ticket_used_over_shared_memory_is_refused_over_tcp_and_back(receiver, segments):
    engine, dst = receiver
    shm, shm_src = sender(segments, host="host-a", transport="auto", fill=1)
    net, net_src = sender(segments, fill=2)
    first = engine.expect(dst.name, [(0, 2 * KiB)], ttl=30)  # sender unknown: TCP may use it
    assert shm.choose_transport(first) == "shm" and first.address is not None
    await shm.write(first, shm_src.name, [Span(0, 0, KiB)])
    with pytest.raises(TransferError) as caught:
        await net.write(first, net_src.name, [Span(KiB, KiB, KiB)])
    assert caught.value.cause == "bad_token"
    assert dst.tensor[KiB : 2 * KiB].count_nonzero() == 0

    second = engine.expect(dst.name, [(4 * KiB, 2 * KiB)], ttl=30)
    await net.write(second, net_src.name, [Span(4 * KiB, 4 * KiB, KiB)])
    with pytest.raises(TransferError) as caught:
        await shm.write(second, shm_src.name, [Span(5 * KiB, 5 * KiB, KiB)])
    assert caught.value.cause == "bad_token"
    assert dst.tensor[5 * KiB : 6 * KiB].count_nonzero() == 0


async def test_an_engine_whose_peers_are_all_local_listens_on_no_port(segments):
    before = listening_ports()
    engine = segments.engine("host-a", listen="127.0.0.1:0")
    dst = segments.segment(engine, 64 * KiB)
    local, src = sender(segments, host="host-a", transport="auto")
    ticket = engine.expect(dst.name, [(0, KiB)], ttl=30, sender_host=local.writer_host_id)
    await local.write(ticket, src.name, [Span(0, 0, KiB)])
    assert ticket.address is None and engine.transports["tcp"].listener is None
    assert listening_ports() == before
    assert dst.tensor[:KiB].eq(7).all()

    remote = engine.expect(dst.name, [(KiB, KiB)], ttl=30, sender_host="host-b")  # now one may need it
    assert listening_ports() - before == {int(remote.address.rsplit(":", 1)[1])}
    with connect(remote.address) as sock:  # and the local ticket is still no good over TCP
        sock.sendall(greeting(ticket.token, nonce=1))
        assert sock.recv(1) == bytes([Status.REFUSED])


def test_forced_tcp_listens_from_the_start_and_says_so_to_receivers(segments):
    engine = segments.engine("host-a", listen="127.0.0.1:0", transport="tcp")
    assert engine.transports["tcp"].listener is not None and engine.writer_host_id is None
    assert segments.engine("host-a").writer_host_id == "host-a"
