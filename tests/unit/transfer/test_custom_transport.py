"""A transport is one class and one registry line: an in-process memcpy transport, known
to no module of the engine, carries a plain transfer and a layer-wise hand-off through
the engine's own APIs (tickets, writers, metrics)."""

import pytest
import torch

from libs.engine.model import steps
from libs.engine.model.engine import EngineConfig
from libs.engine.model.generator import Generator
from libs.engine.model.loader import build_engine
from libs.engine.model.sampling import sample
from libs.engine.model.sequence import Sequence
from libs.protocol.schema import WriteTicket
from libs.protocol.vocabulary import ErrorCode
from libs.transfer import Span, TransferEngine, TransferError, Transport
from libs.transfer.registry import TRANSPORTS
from libs.transfer.segment import SharedSegment
from libs.transfer.writers import SerialWriter, Writer
from tests.unit.transfer.test_layerwise import GREEDY, engine_on_segment

KiB = 1 << 10


class MemcpyTransport(Transport):
    """Copies with memoryview slices into the receiver's segment, mapped in this process."""

    name = "memcpy"
    same_host_only = True

    def can_reach(self, ticket: WriteTicket) -> bool:
        return ticket.host_id == self.host.host_id

    def make_writer(self, ticket: WriteTicket, source: SharedSegment, timeout: float) -> Writer:
        destination = self.host.segment(ticket.segment)
        self.host.claim(ticket)

        def send(spans: list[Span]) -> None:
            for s in spans:
                destination.view[s.dst_offset : s.dst_offset + s.length] = source.view[s.src_offset : s.src_offset + s.length]

        return SerialWriter(source, timeout, self.host.pool, self.name, send)


@pytest.fixture(autouse=True)
def memcpy_registered(monkeypatch):
    monkeypatch.setitem(TRANSPORTS, MemcpyTransport.name, MemcpyTransport)


async def test_a_transfer_goes_through_the_registered_transport(segments):
    receiver = segments.engine("host-a", listen="127.0.0.1:0")
    dst = segments.segment(receiver, 256 * KiB)
    sender = segments.engine("host-a", transport="memcpy")
    src = segments.segment(sender, 256 * KiB)
    src.tensor.copy_(torch.randint(0, 256, (src.nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5)))
    spans = [Span(0, 100 * KiB, 3 * KiB + 1), Span(7, 0, 64 * KiB), Span(200 * KiB, 160 * KiB, 50 * KiB)]
    before = sender.metrics.transfers.value("memcpy")

    ticket = receiver.expect(dst.name, [(s.dst_offset, s.length) for s in spans], ttl=30,
                             sender_host=sender.writer_host_id)  # fmt: skip
    assert ticket.address is None and receiver.transports["tcp"].listener is None  # same host: nothing listens
    assert sender.choose_transport(ticket) == "memcpy"
    await sender.write(ticket, src.name, spans)

    expected = torch.zeros_like(dst.tensor)
    for s in spans:
        expected[s.dst_offset : s.dst_offset + s.length] = src.tensor[s.src_offset : s.src_offset + s.length]
    assert torch.equal(dst.tensor, expected)
    assert sender.metrics.transfers.value("memcpy") == before + 1
    assert isinstance(sender.transports["memcpy"], MemcpyTransport)


def test_a_registered_transport_is_one_to_choose_and_others_are_refused():
    with pytest.raises(ValueError, match="'memcpy'.*got 'carrier-pigeon'"):
        TransferEngine("host-a", transport="carrier-pigeon")


async def test_a_layerwise_hand_off_through_the_registered_transport_decodes_as_one_process(smollm, segments):
    prompt = smollm.tokenizer.encode_chat([{"role": "user", "content": "Name three rivers, briefly."}])
    expected = Generator(build_engine(smollm, EngineConfig(num_blocks=64)), smollm.tokenizer).generate([prompt], GREEDY)[0]

    receiver_engine = segments.engine("one-host")
    sender_engine = segments.engine("one-host", transport="memcpy")
    prefill, prefill_segment = engine_on_segment(smollm, segments, sender_engine, 32)
    decode, decode_segment = engine_on_segment(smollm, segments, receiver_engine, 32)
    layout = prefill.pool.layout

    lease = decode.cache.block_pool.allocate(decode.cache.blocks_needed(len(prompt)))
    ticket = receiver_engine.expect(decode_segment.name, [decode.pool.block_range(b) for b in lease], ttl=60,
                                    sender_host=sender_engine.writer_host_id)  # fmt: skip
    seq = Sequence.from_prompt("r", prompt, GREEDY)
    writer = sender_engine.writer(ticket, prefill_segment.name)
    assert writer.transport == "memcpy"
    shipped = []

    def ship(layer: int, done: list[Sequence]) -> None:
        shipped.append(layer)
        writer.submit([
            Span(prefill.pool.block_range(src, layer)[0], decode.pool.block_range(dst, layer)[0], layout.layer_nbytes)
            for src, dst in zip(seq.block_table, lease)
        ])  # fmt: skip

    first = sample(steps.prefill(prefill, [seq], layer_done=ship), [GREEDY], [0])[0]
    await sender_engine.finish(writer)
    assert shipped == list(range(layout.num_layers))
    assert writer.bytes == len(lease) * layout.num_layers * layout.layer_nbytes

    resumed = Sequence("r", prompt + [first], len(prompt), GREEDY, block_table=list(lease),
                       num_computed_tokens=len(prompt))  # fmt: skip
    while resumed.num_output_tokens < GREEDY.max_tokens:
        resumed.append_token(sample(steps.decode(decode, [resumed]), [GREEDY], [resumed.num_output_tokens])[0])
    assert resumed.output_token_ids == expected.token_ids


async def test_a_writer_of_a_closed_engine_fails_instead_of_waiting(segments):
    receiver = segments.engine("host-a")
    dst = segments.segment(receiver, 4 * KiB)
    sender = segments.engine("host-a", transport="memcpy")
    src = segments.segment(sender, 4 * KiB)
    ticket = receiver.expect(dst.name, [(0, KiB)], ttl=30, sender_host=sender.writer_host_id)
    writer = sender.writer(ticket, src.name)
    sender.close()  # its pool takes no more work
    writer.submit([Span(0, 0, KiB)])
    with pytest.raises(TransferError) as caught:
        await sender.finish(writer)
    assert caught.value.cause == ErrorCode.CANCELLED
