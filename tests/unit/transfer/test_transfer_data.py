"""Bytes arrive bit-exact over both transports, and only where a ticket allows."""

import random

import pytest
import torch

from libs.protocol.schema import WriteTicket
from libs.transfer import Span, TransferError

MiB = 1 << 20
SIZES = [1, 7, 4096 + 3, 65_537, MiB + 13, 16 * MiB, 256 * MiB]


@pytest.fixture
def link(segments):
    receiver = segments.engine("host-a", listen="127.0.0.1:0")
    dst = segments.segment(receiver, 256 * MiB + 4096)
    senders = {t: segments.engine("host-a", transport=t, connections=4, slice_bytes=4 * MiB) for t in ("shm", "tcp")}
    srcs = {t: segments.segment(senders[t], 256 * MiB + 4096) for t in senders}
    for src in srcs.values():
        src.tensor.copy_(torch.randint(0, 256, (src.nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)))
    return receiver, dst, senders, srcs


@pytest.mark.parametrize("transport", ["shm", "tcp"])
async def test_random_data_of_many_sizes_arrives_bit_exact(link, transport):
    receiver, dst, senders, srcs = link
    src = srcs[transport]
    for size in SIZES:
        dst.tensor.zero_()
        src_at, dst_at = 5, 4093  # unaligned on both sides
        ticket = receiver.expect(dst.name, [(dst_at, size)], ttl=60)
        await senders[transport].write(ticket, src.name, [Span(src_at, dst_at, size)])
        receiver.close_ticket(ticket.token)
        assert torch.equal(dst.tensor[dst_at : dst_at + size], src.tensor[src_at : src_at + size]), size
        assert dst.tensor[:dst_at].count_nonzero() == 0 and dst.tensor[dst_at + size :].count_nonzero() == 0


@pytest.mark.parametrize("transport", ["shm", "tcp"])
async def test_many_descriptors_in_one_batch(link, transport):
    receiver, dst, senders, srcs = link
    rng = random.Random(7)
    spans, cursor = [], 11
    for _ in range(500):
        length = rng.randint(1, 200_000)
        spans.append(Span(rng.randint(0, 100 * MiB), cursor, length))
        cursor += length + rng.randint(0, 999)
    rng.shuffle(spans)
    dst.tensor.zero_()
    ticket = receiver.expect(dst.name, [(s.dst_offset, s.length) for s in spans], ttl=60)
    await senders[transport].write(ticket, srcs[transport].name, spans)
    expected = torch.zeros_like(dst.tensor)
    for s in spans:
        expected[s.dst_offset : s.dst_offset + s.length] = srcs[transport].tensor[s.src_offset : s.src_offset + s.length]
    assert torch.equal(dst.tensor, expected)


def test_the_transport_is_chosen_by_host(segments):
    receiver = segments.engine("host-a", listen="127.0.0.1:0")
    dst = segments.segment(receiver, 4096)
    ticket = receiver.expect(dst.name, [(0, 10)], ttl=5)
    assert segments.engine("host-a").choose_transport(ticket) == "shm"
    assert segments.engine("host-b").choose_transport(ticket) == "tcp"
    assert segments.engine("host-a", transport="tcp").choose_transport(ticket) == "tcp"


async def test_writes_outside_the_ticket_are_refused_and_nothing_lands(segments):
    receiver = segments.engine("host-a", listen="127.0.0.1:0")
    dst = segments.segment(receiver, MiB)
    sender = segments.engine("host-a", transport="tcp")
    src = segments.segment(sender, MiB)
    src.tensor.fill_(9)
    ticket = receiver.expect(dst.name, [(0, 1000)], ttl=30)
    with pytest.raises(TransferError) as caught:
        await sender.write(ticket, src.name, [Span(0, 500, 1000)])
    assert caught.value.cause == "bad_range"
    assert dst.tensor.count_nonzero() == 0


async def test_a_wrong_closed_or_expired_token_is_refused_before_a_byte_is_written(segments):
    receiver = segments.engine("host-a", listen="127.0.0.1:0")
    dst = segments.segment(receiver, MiB)
    sender = segments.engine("host-a", transport="tcp")
    src = segments.segment(sender, MiB)
    src.tensor.fill_(3)
    good = receiver.expect(dst.name, [(0, MiB)], ttl=30)
    forged = WriteTicket(token="f" * 32, host_id=good.host_id, segment=good.segment, address=good.address)
    closed = receiver.expect(dst.name, [(0, MiB)], ttl=30)
    receiver.close_ticket(closed.token)
    expired = receiver.expect(dst.name, [(0, MiB)], ttl=-1)
    for ticket in (forged, closed, expired):
        with pytest.raises(TransferError) as caught:
            await sender.write(ticket, src.name, [Span(0, 0, 4096)])
        assert caught.value.cause == "bad_token"
    assert dst.tensor.count_nonzero() == 0
    await sender.write(good, src.name, [Span(0, 0, 4096)])  # the real ticket still works
    assert dst.tensor[:4096].eq(3).all()
