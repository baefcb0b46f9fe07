"""Layer-wise hand-off: each layer's KV ships as soon as it is computed, arrives
layer after layer, and the receiving engine decodes exactly what one process does."""

import torch

from libs.engine.model import steps
from libs.engine.model.engine import EngineConfig
from libs.engine.model.generator import Generator
from libs.engine.model.loader import build_engine
from libs.engine.model.sampling import sample
from libs.engine.model.sequence import Sequence
from libs.protocol.sampling_params import SamplingParams
from libs.transfer import Span

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def engine_on_segment(loaded, segments, transfer_engine, num_blocks: int):
    layout = loaded.kv_layout(16)
    segment = segments.segment(transfer_engine, num_blocks * layout.block_nbytes)
    return build_engine(loaded, EngineConfig(num_blocks=num_blocks, max_chunk_tokens=16), pool_buffer=segment.tensor), segment


async def test_layers_arrive_in_order_and_decode_matches_one_process(smollm, segments):
    prompt = smollm.tokenizer.encode_chat([{"role": "user", "content": "Explain what a lighthouse does, briefly."}])
    expected = Generator(build_engine(smollm, EngineConfig(num_blocks=64)), smollm.tokenizer).generate([prompt], GREEDY)[0]

    receiver_engine = segments.engine("decode-host", listen="127.0.0.1:0")
    sender_engine = segments.engine("prefill-host", transport="tcp", connections=3)
    prefill, prefill_segment = engine_on_segment(smollm, segments, sender_engine, 32)
    decode, decode_segment = engine_on_segment(smollm, segments, receiver_engine, 32)
    layout = prefill.pool.layout

    # the decode side leases blocks for the prompt and issues a ticket for exactly them
    lease = decode.cache.block_pool.allocate(decode.cache.blocks_needed(len(prompt)))
    ticket = receiver_engine.expect(decode_segment.name, [decode.pool.block_range(b) for b in lease], ttl=60)

    seq = Sequence.from_prompt("r", prompt, GREEDY)
    writer = sender_engine.writer(ticket, prefill_segment.name)
    shipped = []

    def ship(layer: int, done: list[Sequence]) -> None:
        assert done == [seq]
        shipped.append(layer)
        writer.submit([
            Span(prefill.pool.block_range(src, layer)[0], decode.pool.block_range(dst, layer)[0], layout.layer_nbytes)
            for src, dst in zip(seq.block_table, lease)
        ])  # fmt: skip

    first = sample(steps.prefill(prefill, [seq], layer_done=ship), [GREEDY], [0])[0]  # chunks of 16: layers ship with the last
    await sender_engine.finish(writer)
    assert shipped == list(range(layout.num_layers))

    arrivals = receiver_engine.close_ticket(ticket.token).arrivals
    assert sum(n for _, n in arrivals) == len(lease) * layout.num_layers * layout.layer_nbytes
    last_arrival = {}
    for index, (offset, _) in enumerate(arrivals):
        last_arrival[(offset % layout.block_nbytes) // layout.layer_nbytes] = index
    completion_order = sorted(last_arrival, key=last_arrival.get)
    assert completion_order == list(range(layout.num_layers))  # each layer complete before the next

    # the decode side resumes from the shipped KV alone
    resumed = Sequence("r", prompt + [first], len(prompt), GREEDY, block_table=list(lease),
                       num_computed_tokens=len(prompt))  # fmt: skip
    while resumed.num_output_tokens < GREEDY.max_tokens:
        resumed.append_token(sample(steps.decode(decode, [resumed]), [GREEDY], [resumed.num_output_tokens])[0])
    assert resumed.output_token_ids == expected.token_ids
    assert torch.equal(
        prefill.pool.kv[seq.block_table[0]], decode.pool.kv[lease[0]]
    )  # and the first block arrived bit for bit
