"""Sealed records (libs/transfer/tcp/sealed.py), the data plane's bytes after a TLS
session agreed the keys: what goes in comes out, in any size of read; nothing of the
plain bytes is on the wire; a record changed, replayed, dropped or too long ends the
connection (at a listener: the transfer fails with cause `tls`, nothing written); a peer
of another version is refused in the key exchange; a non-blocking send asked again with
the same bytes sends them once; a read that would block keeps what it has; a connection
whose keys have sealed enough is not reused."""

import asyncio
import functools
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from libs.common.tls import mutual_context
from libs.protocol.vocabulary import ErrorCode
from libs.transfer import Span, TransferError
from libs.transfer.tcp import sealed
from libs.transfer.tcp.connection import IdleConnections, TcpConnection
from libs.transfer.tcp.sealed import (
    HEADER,
    RECORD_BYTES,
    TAG,
    SealedSocket,
    SealError,
    derive_keys,
    new_secret,
    seal_sender,
)
from libs.transfer.tcp.wire import FRAME, Status, greeting
from libs.transfer.tickets import Refusal
from tests.unit.transfer.test_tls import SIZE, make_pair, write_all
from tests.unit.transfer.tls_certs import TestCA


@pytest.fixture
def pair():
    """Two sealed ends of one connection, and the plain sockets under them."""
    a, b = socket.socketpair()
    a.settimeout(10)
    b.settimeout(10)
    to_b, to_a = derive_keys(new_secret(), new_secret())
    yield SealedSocket(a, to_b, to_a), SealedSocket(b, to_a, to_b), a, b
    a.close()
    b.close()


def read_exact(sock, n: int, step: int | None = None) -> bytes:
    out = bytearray(n)
    view = memoryview(out)
    got = 0
    while got < n:
        k = sock.recv_into(view[got : got + (step or n - got)])
        assert k, "the stream ended early"
        got += k
    return bytes(out)


def raw_records(sock: socket.socket, count: int) -> list[bytes]:
    """``count`` records as they are on the wire, read from the plain socket."""
    records = []
    for _ in range(count):
        head = read_exact(sock, HEADER.size)
        (length,) = HEADER.unpack(head)
        records.append(head + read_exact(sock, length + TAG))
    return records


@pytest.mark.parametrize("size", [1, 16, RECORD_BYTES - 1, RECORD_BYTES, 2 * RECORD_BYTES + 12345])
def test_bytes_sent_come_out_the_same_read_whole_or_in_small_pieces(pair, size):
    a, b, _, _ = pair
    data = os.urandom(size)
    with ThreadPoolExecutor(1) as writer:
        sending = writer.submit(lambda: (a.sendall(data), a.sendall(data)))
        assert read_exact(b, size) == data  # whole records straight into the buffer
        assert read_exact(b, size, step=7000) == data  # a record longer than the read: the rest is kept
        sending.result()


def test_parts_sent_together_are_records_of_their_own_and_small_records_read_together_come_out_one_by_one(pair):
    a, b, _, _ = pair
    header, payload = os.urandom(16), os.urandom(2 * RECORD_BYTES + 5)
    with ThreadPoolExecutor(1) as writer:
        sending = writer.submit(lambda: (a.sendall_parts([header, payload]), a.sendall(b"x"), a.sendall(b"yz")))
        assert read_exact(b, 16) == header  # the header's own record: no part of the payload in it
        assert read_exact(b, len(payload)) == payload
        sending.result()
    assert b.recv(100) == b"x" and b.recv(100) == b"yz"  # read in one go or not, each record comes out alone


def test_the_plain_bytes_are_not_on_the_wire_and_each_record_carries_its_length_and_tag(pair):
    a, _, _, b_plain = pair
    data = bytes(range(256)) * 4096 + b"secret prompt"  # 1 MiB and a little: two records
    with ThreadPoolExecutor(1) as writer:
        sending = writer.submit(a.sendall, data)
        first, second = raw_records(b_plain, 2)
        sending.result()
    assert len(first) == HEADER.size + RECORD_BYTES + TAG and len(second) == HEADER.size + 13 + TAG
    assert bytes(range(64)) not in first and b"secret prompt" not in second


def test_a_changed_record_fails_its_check(pair):
    a, b, a_plain, b_plain = pair
    a.sendall(b"x" * 100)
    (record,) = raw_records(b_plain, 1)
    changed = bytearray(record)
    changed[HEADER.size + 10] ^= 1
    a_plain.sendall(changed)  # as if the wire had flipped a bit
    with pytest.raises(SealError):
        b.recv(100)


def test_a_replayed_or_dropped_record_fails_its_check(pair):
    a, b, a_plain, b_plain = pair
    a.sendall(b"first")
    a.sendall(b"second")
    first, second = raw_records(b_plain, 2)
    a_plain.sendall(first)
    assert b.recv(5) == b"first"
    a_plain.sendall(first)  # the same record again: its nonce is spent
    with pytest.raises(SealError):
        b.recv(5)

    a2, b2 = socket.socketpair()
    to_b, to_a = derive_keys(new_secret(), new_secret())
    sender, receiver = SealedSocket(a2, to_b, to_a), SealedSocket(b2, to_a, to_b)
    sender.sendall(b"first")
    sender.sendall(b"second")
    first, second = raw_records(b2, 2)
    a2.sendall(second)  # the first record dropped
    with pytest.raises(SealError):
        receiver.recv(6)
    a2.close()
    b2.close()


@pytest.mark.parametrize("length", [0, RECORD_BYTES + 1])
def test_a_record_longer_than_any_sender_seals_or_empty_is_refused_before_it_is_read(pair, length):
    a, b, a_plain, _ = pair
    a.sendall(b"")
    assert a.send(b"") == 0  # nothing to send: no record
    a_plain.sendall(HEADER.pack(length))
    with pytest.raises(SealError, match=f"1 to {RECORD_BYTES}"):
        b.recv(10)


def test_keys_from_other_secrets_open_nothing(pair):
    a, _, _, b_plain = pair
    to_b, to_a = derive_keys(new_secret(), new_secret())
    stranger = SealedSocket(b_plain, to_a, to_b)
    a.sendall(b"hello")
    with pytest.raises(SealError):
        stranger.recv(5)


def test_a_send_that_would_block_is_asked_again_with_the_same_bytes_and_sent_once(pair):
    a, b, a_plain, _ = pair
    a_plain.setblocking(False)
    record = os.urandom(RECORD_BYTES)
    whole = 0
    while True:  # fill the socket's buffers until a record cannot go whole
        try:
            assert a.send(record) == RECORD_BYTES
            whole += 1
        except BlockingIOError:
            break
    with ThreadPoolExecutor(1) as reader:
        received = reader.submit(lambda: [read_exact(b, RECORD_BYTES) for _ in range(whole + 1)] + [b.recv(3)])
        a_plain.settimeout(10)  # blocking again, within a bound
        assert a.send(record) == RECORD_BYTES  # the blocked record, finished
        a.sendall(b"end")
        assert received.result(timeout=30) == [record] * (whole + 1) + [b"end"]  # each record once


def test_a_read_that_would_block_keeps_the_part_of_a_record_it_has(pair):
    a, b, a_plain, b_plain = pair
    a.sendall(b"a whole record")
    (record,) = raw_records(b_plain, 1)
    b_plain.setblocking(False)
    for cut in (2, HEADER.size + 5):  # inside the header, then inside the sealed bytes
        a_plain.sendall(record[: cut] if cut == 2 else record[2:cut])
        with pytest.raises(BlockingIOError):
            b.recv(100)
    a_plain.sendall(record[HEADER.size + 5 :])
    assert b.recv(100) == b"a whole record"


def test_the_end_of_the_stream_inside_a_record_reads_as_the_end(pair):
    a, b, a_plain, b_plain = pair
    a.sendall(b"cut short")
    (record,) = raw_records(b_plain, 1)
    a_plain.sendall(record[:-3])
    a_plain.shutdown(socket.SHUT_WR)
    assert b.recv(100) == b""


async def test_a_connection_whose_keys_sealed_enough_is_closed_not_pooled(segments, tmp_path, monkeypatch):
    cluster = TestCA(tmp_path, "cluster")
    receiver, dst, sender, src = make_pair(segments, cluster.leaf("receiver"), cluster.leaf("sender"))
    ticket = await write_all(receiver, dst, sender, src)
    pooled = sender.transports["tcp"].idle.take(ticket.address)
    assert pooled is not None  # under the limit: pooled
    pooled.close()
    monkeypatch.setattr(sealed, "KEY_BYTES_LIMIT", SIZE // 4)
    dst.tensor.zero_()
    ticket = receiver.expect(dst.name, [(0, SIZE)], ttl=30)
    try:
        await sender.write(ticket, src.name, [Span(0, 0, SIZE)])
    finally:
        receiver.close_ticket(ticket.token)
    assert torch.equal(dst.tensor, src.tensor)
    assert sender.transports["tcp"].idle.take(ticket.address) is None


def tls_receiver(segments, tmp_path):
    """A receiver with TLS and a ticket for its segment, for senders made by hand: the CA,
    the receiver, the segment, the ticket, a sender's client context and the address."""
    cluster = TestCA(tmp_path, "cluster")
    receiver = segments.engine("host-a", listen="127.0.0.1:0", tls=cluster.leaf("receiver"))
    dst = segments.segment(receiver, SIZE)
    ticket = receiver.expect(dst.name, [(0, SIZE)], ttl=30)
    host, port = ticket.address.rsplit(":", 1)
    return cluster, receiver, dst, ticket, mutual_context(cluster.leaf("sender"), server=False), (host, int(port))


async def test_a_record_changed_on_the_wire_fails_the_transfer_at_the_receiver_and_writes_nothing(segments, tmp_path):
    _, receiver, dst, ticket, client, address = tls_receiver(segments, tmp_path)

    def send_a_changed_frame() -> tuple[bytes, bytes]:
        with socket.create_connection(address, timeout=10) as raw:
            conn = seal_sender(client.wrap_socket(raw))  # a sender by hand: the session, the keys, a greeting
            conn.sendall(greeting(ticket.token, 7))
            greeted = conn.recv(1)
            conn.sendall(FRAME.pack(0, 64))
            record = bytearray(HEADER.size + 64 + TAG)
            conn._seal_into(b"\xff" * 64, memoryview(record))
            record[-1] ^= 1  # the tag no longer matches
            conn._sock.sendall(record)
            return greeted, conn.recv(1)

    greeted, status = await asyncio.to_thread(send_a_changed_frame)
    closed = receiver.close_ticket(ticket.token)
    assert greeted == bytes([Status.OK]) and status == bytes([Status.FAILED])
    assert closed.failed == ErrorCode.TLS
    assert not dst.tensor.any() and receiver.metrics.received.value() == 0


async def test_peers_of_another_version_are_refused_in_the_key_exchange_with_the_reason(segments, tmp_path):
    cluster, receiver, dst, ticket, client, address = tls_receiver(segments, tmp_path)

    def an_older_sender() -> bytes:  # its greeting straight inside TLS, with no key exchange
        with socket.create_connection(address, timeout=10) as raw, client.wrap_socket(raw) as tls:
            tls.sendall(greeting(ticket.token, 7))
            return tls.recv(1)

    assert await asyncio.to_thread(an_older_sender) == b""  # closed, not greeted
    assert receiver.metrics.refused.value(Refusal.TLS_HANDSHAKE) == 1 and not dst.tensor.any()
    receiver.close_ticket(ticket.token)

    server = mutual_context(cluster.leaf("receiver"), server=True)
    with socket.create_server(("127.0.0.1", 0)) as listening:

        def an_older_receiver() -> None:  # reads a greeting inside TLS and refuses it
            conn, _ = listening.accept()
            with server.wrap_socket(conn, server_side=True) as tls:
                tls.recv(64)
                tls.sendall(bytes([Status.REFUSED]))

        older = asyncio.create_task(asyncio.to_thread(an_older_receiver))
        host, port = listening.getsockname()[:2]
        connection = functools.partial(TcpConnection, f"{host}:{port}", "token", time.monotonic() + 10,
                                       IdleConnections(), tls=client)  # fmt: skip
        with pytest.raises(TransferError) as caught:
            await asyncio.to_thread(connection)
        await older
    assert caught.value.cause == ErrorCode.TLS and "another version" in str(caught.value)
