"""TCP connections are reused across transfers to the same receiver, each transfer
still needs its own token, and a small transfer opens only the connections it uses."""

import socket

import pytest
import torch

from libs.transfer import Span, TransferError
from libs.transfer.tcp.wire import END_OFFSET, FRAME, GREETING, MAGIC, Status, greeting
from libs.transfer.tickets import greeting_proof, ticket_id
from tests.integration.conftest import wait_until

KiB = 1 << 10


def make_link(segments, **receiver_settings):
    receiver = segments.engine("host-a", listen="127.0.0.1:0", **receiver_settings)
    dst = segments.segment(receiver, 1 << 20)
    sender = segments.engine("host-b", transport="tcp", connections=4)
    src = segments.segment(sender, 1 << 20)
    src.tensor.copy_(torch.randint(0, 256, (src.nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)))
    return receiver, dst, sender, src


@pytest.fixture
def link(segments):
    return make_link(segments)  # a new sender engine: no connection left over from another test


async def send(receiver, dst, sender, src, offset: int, size: int = 64 * KiB) -> None:
    ticket = receiver.expect(dst.name, [(offset, size)], ttl=30)
    await sender.write(ticket, src.name, [Span(offset, offset, size)])
    receiver.close_ticket(ticket.token)
    assert torch.equal(dst.tensor[offset : offset + size], src.tensor[offset : offset + size])


async def test_transfers_to_one_receiver_share_one_connection(link):
    receiver, dst, sender, src = link
    for i in range(5):
        await send(receiver, dst, sender, src, offset=i * 64 * KiB)
    # one connection, although each writer may use up to 4: a 64 KiB transfer is one slice
    assert receiver.transports["tcp"].listener.accepted == 1


async def test_a_connection_the_receiver_closed_while_idle_is_replaced(segments):
    receiver, dst, sender, src = make_link(segments, idle_timeout=0.2)  # gives up on idle connections at once
    await send(receiver, dst, sender, src, offset=0)
    wait_until(lambda: receiver.transports["tcp"].listener.open_connections == 0, timeout=10)
    await send(receiver, dst, sender, src, offset=64 * KiB)  # the pooled one is dead: a new one
    assert receiver.transports["tcp"].listener.accepted == 2


def test_a_reused_connection_still_needs_a_valid_token_for_each_transfer(segments):
    receiver = segments.engine("rx", listen="127.0.0.1:0")
    dst = segments.segment(receiver, 4096)
    first = receiver.expect(dst.name, [(0, 16)], ttl=30)
    second = receiver.expect(dst.name, [(16, 16)], ttl=30)
    host, port = first.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(greeting(first.token, nonce=1))
        assert sock.recv(1) == bytes([Status.OK])
        sock.sendall(FRAME.pack(0, 16) + b"a" * 16 + FRAME.pack(END_OFFSET, 0))
        assert sock.recv(1) == bytes([Status.OK])
        sock.sendall(greeting(second.token, nonce=1))  # the next transfer, with its own ticket
        assert sock.recv(1) == bytes([Status.OK])
        sock.sendall(FRAME.pack(16, 16) + b"b" * 16 + FRAME.pack(END_OFFSET, 0))
        assert sock.recv(1) == bytes([Status.OK])
        # a ticket's id with a proof made from another token: refused, and the connection closed
        sock.sendall(MAGIC + GREETING.pack(ticket_id(first.token), 2, greeting_proof(second.token, 2)))
        assert sock.recv(1) == bytes([Status.REFUSED])
        assert sock.recv(1) == b""
    assert bytes(dst.tensor[:32].tolist()) == b"a" * 16 + b"b" * 16


async def test_a_refused_token_on_a_pooled_connection_is_an_error_not_a_retry(link):
    receiver, dst, sender, src = link
    await send(receiver, dst, sender, src, offset=0)
    ticket = receiver.expect(dst.name, [(0, 16)], ttl=30)
    receiver.close_ticket(ticket.token)  # closed before use
    with pytest.raises(TransferError) as caught:
        await sender.write(ticket, src.name, [Span(0, 0, 16)])
    assert caught.value.cause == "bad_token"
