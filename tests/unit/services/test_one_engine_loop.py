"""The decode worker and `kvserve chat`'s Generator run one scheduler: for the same
requests, greedy and seeded, sent together so they share the worker's batch, the
worker streams exactly the Generator's tokens and finish reasons."""

import asyncio

import nats
import pytest

from libs.common.nats_server import NatsServer
from libs.common.settings import ModelSettings
from libs.engine.model.engine import EngineConfig
from libs.engine.model.generator import Generator
from libs.engine.model.loader import build_engine
from libs.protocol import schema, subjects
from libs.protocol.sampling_params import SamplingParams
from libs.protocol.schema import Ack, PrefillRequest, TokenChunk
from services.decode.settings import DecodeSettings
from services.decode.worker import DecodeWorker

WAIT = 120.0  # seconds a whole stream may take on a busy machine
BLOCK_SIZE, NUM_BLOCKS = 16, 64

PROMPTS = [list(range(40 + 5 * i, 40 + 5 * i + 9 + 13 * i)) for i in range(4)]  # 9, 22, 35, 48 tokens
PARAMS = [
    SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=14, temperature=0),
    SamplingParams(max_tokens=20, temperature=1.2, top_k=40, seed=3),
]


@pytest.fixture(scope="module")
def nats_server():
    with NatsServer() as server:
        yield server


async def stream(nc: nats.NATS, request_id: str) -> asyncio.Future:
    """A future of every chunk on ``request_id``'s token subject, up to its last."""
    done: asyncio.Future[list[TokenChunk]] = asyncio.get_running_loop().create_future()
    chunks: list[TokenChunk] = []

    async def on_chunk(msg) -> None:
        chunk = schema.decode(msg.data, TokenChunk)
        chunks.append(chunk)
        if chunk.finish_reason is not None and not done.done():
            done.set_result(chunks)

    await nc.subscribe(subjects.request_tokens(request_id), cb=on_chunk)
    return done


async def started(nc: nats.NATS, instance_id: str) -> asyncio.Future:
    """A future that resolves once ``instance_id`` calls its roll (it does so when subscribed)."""
    ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def on_roll_call(msg) -> None:
        if schema.decode(msg.data, schema.RollCall).instance_id == instance_id and not ready.done():
            ready.set_result(None)

    await nc.subscribe(subjects.ROLL_CALL, cb=on_roll_call)
    return ready


async def test_the_decode_worker_streams_the_generators_tokens(nats_server, tiny_checkpoint, tiny_model):
    engine = build_engine(tiny_model, EngineConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS))
    expected = Generator(engine, tiny_model.tokenizer).generate(PROMPTS, PARAMS)

    model = ModelSettings(model=str(tiny_checkpoint), device="cpu", dtype="float32", block_size=BLOCK_SIZE,
                          num_blocks=NUM_BLOCKS, max_model_len=None)  # fmt: skip
    settings = DecodeSettings(role="decode", nats_url=nats_server.url, instance_id="decode-loop", host_id="h",
                              model=model)  # fmt: skip
    worker = DecodeWorker(settings)
    nc = await nats.connect(nats_server.url)
    ready = await started(nc, "decode-loop")
    running = asyncio.create_task(worker.run())
    try:
        await asyncio.wait_for(ready, WAIT)
        ids = [f"loop-{i}" for i in range(len(PROMPTS))]
        streams = [await stream(nc, request_id) for request_id in ids]
        requests = [PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling=params, decode_id="decode-loop")
                    for rid, prompt, params in zip(ids, PROMPTS, PARAMS)]  # fmt: skip
        subject = subjects.decode_prefill("decode-loop")
        replies = await asyncio.gather(*(nc.request(subject, schema.encode(r), timeout=WAIT) for r in requests))
        assert all(isinstance(schema.decode_reply(r.data, Ack), Ack) for r in replies)
        results = await asyncio.wait_for(asyncio.gather(*streams), WAIT)
        for chunks, want in zip(results, expected):
            assert [c.index for c in chunks] == list(range(len(chunks)))
            assert [t for c in chunks for t in c.token_ids] == want.token_ids
            assert chunks[-1].finish_reason == want.finish_reason
            assert chunks[0].num_prompt_tokens == len(want.prompt_token_ids)
        # every finished request gave its blocks back (the heartbeat reports what the loop holds)
        beat = worker.heartbeat()
        assert (beat.free_blocks, beat.load, beat.batch_size) == (NUM_BLOCKS, 0, 0)
    finally:
        worker.stopping.set()
        await running
        await nc.close()
