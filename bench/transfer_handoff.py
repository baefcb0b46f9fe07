"""The KV hand-off of one long prompt, for bench/transfer.py: (a) prefill alone,
(b) prefill then every block shipped whole, (c) prefill with each layer shipped
from ``layer_done`` while the next one computes — over shm and TCP, to a
receiver in another process (a ``transfer_peer.py kvserve`` peer).

The prefill side is built as the prefill worker builds it: the KV pool viewed
over a registered shared-memory segment, spans shaped as
services/prefill/handoff.py shapes them (one range per block, or one range per
block per layer). The ticket is fetched before the clock starts, as the worker
leases blocks on the decode side before it prefills.
"""

import hashlib
import time
from collections.abc import Callable

import msgspec
import torch

from libs.engine.model import steps
from libs.engine.model.engine import EngineConfig
from libs.engine.model.loader import LoadedModel, build_engine
from libs.engine.model.sequence import Sequence
from libs.protocol.schema import WriteTicket
from libs.transfer import SharedSegment, Span, TransferEngine
from libs.transfer.segment import new_segment_name

PROMPT_TOKENS = 2048
BLOCK_SIZE = 16
TRANSPORTS = ("shm", "tcp")
LAYERWISE_TIMEOUT = 600.0


def kv_bytes(loaded: LoadedModel) -> int:
    """Bytes of the prompt's KV: what one hand-off moves (also the receiver's room needed)."""
    return PROMPT_TOKENS // BLOCK_SIZE * loaded.kv_layout(BLOCK_SIZE).block_nbytes


def random_prompt(n: int, seed: int) -> list[int]:
    return torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class HandoffBench:
    def __init__(self, loaded: LoadedModel, chunk_tokens: int, peer) -> None:
        self.peer = peer
        self.layout = loaded.kv_layout(BLOCK_SIZE)
        self.num_prompt_blocks = PROMPT_TOKENS // BLOCK_SIZE
        num_blocks = self.num_prompt_blocks + 8
        self.segment = SharedSegment.create(new_segment_name("bench", "pool"), num_blocks * self.layout.block_nbytes)
        self.transfers = {t: TransferEngine("bench-host", transport=t) for t in TRANSPORTS}
        for engine in self.transfers.values():
            engine.register(self.segment)
        config = EngineConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks, max_chunk_tokens=chunk_tokens,
                              enable_prefix_cache=False)  # fmt: skip
        self.engine = build_engine(loaded, config, pool_buffer=self.segment.tensor)

    def close(self) -> None:
        self.engine = None  # drop the pool's view of the segment before unmapping it
        for engine in self.transfers.values():
            engine.close()  # closes (and unlinks) the registered pool segment too
        self.segment.close()

    # --- spans, as services/prefill/handoff.py builds them ----------------------
    def block_spans(self, seq: Sequence) -> list[Span]:
        n = self.layout.block_nbytes
        return [Span(self.engine.pool.block_range(b)[0], i * n, n) for i, b in enumerate(self._blocks(seq))]

    def layer_spans(self, seq: Sequence, layer: int) -> list[Span]:
        offset, n = layer * self.layout.layer_nbytes, self.layout.layer_nbytes
        return [
            Span(self.engine.pool.block_range(b)[0] + offset, i * self.layout.block_nbytes + offset, n)
            for i, b in enumerate(self._blocks(seq))
        ]

    def _blocks(self, seq: Sequence) -> list[int]:
        return seq.block_table[: self.num_prompt_blocks]

    # --- the three ways --------------------------------------------------------
    def _ticket(self) -> WriteTicket:
        return msgspec.convert(self.peer.ask("tickets", 1)["tickets"][0], WriteTicket)

    async def prefill_only(self, seq: Sequence) -> dict[str, float]:
        start = time.perf_counter()
        steps.prefill(self.engine, [seq])
        return {"prefill": time.perf_counter() - start}

    async def serial(self, seq: Sequence, transport: str) -> dict[str, float]:
        ticket, transfers = self._ticket(), self.transfers[transport]
        start = time.perf_counter()
        steps.prefill(self.engine, [seq])
        computed = time.perf_counter()
        writer = transfers.writer(ticket, self.segment.name)
        writer.submit(self.block_spans(seq))
        await transfers.finish(writer)
        end = time.perf_counter()
        return {"e2e": end - start, "transfer": end - computed}

    async def layerwise(self, seq: Sequence, transport: str) -> dict[str, float]:
        ticket, transfers = self._ticket(), self.transfers[transport]
        start = time.perf_counter()
        # Opened before the prefill, as the worker does. Its deadline runs from here, through the
        # prefill: the default 30 s is shorter than a 2,048-token prefill on a busy 2-core machine.
        writer = transfers.writer(ticket, self.segment.name, timeout=LAYERWISE_TIMEOUT)
        steps.prefill(self.engine, [seq], layer_done=lambda layer, done: writer.submit(self.layer_spans(seq, layer)))
        computed = time.perf_counter()
        await transfers.finish(writer)
        end = time.perf_counter()
        return {"e2e": end - start, "compute": computed - start, "tail": end - computed}

    def modes(self) -> dict[str, Callable]:
        modes = {"prefill": self.prefill_only}
        for t in TRANSPORTS:
            modes[f"serial-{t}"] = lambda seq, t=t: self.serial(seq, t)
            modes[f"layerwise-{t}"] = lambda seq, t=t: self.layerwise(seq, t)
        return modes

    # --- one configuration, every mode, alternating --------------------------------
    async def run(self, reps: int, log: Callable[[str], None]) -> dict:
        modes = self.modes()
        names = list(modes)
        await self._once(modes["prefill"], seed=10_000)  # warm-up
        samples: dict[str, list[dict[str, float]]] = {name: [] for name in modes}
        for rep in range(reps):
            order = names[rep % len(names) :] + names[: rep % len(names)]
            for name in order:  # the first repetition also checks every byte arrived where the decode side expects it
                check = name if rep == 0 and name != "prefill" else None
                samples[name].append(await self._once(modes[name], seed=rep, check=check))
            log(f"    rep {rep + 1}/{reps}: " + ", ".join(f"{n} {samples[n][-1].get('e2e', samples[n][-1].get('prefill')):.3f}s"
                                                  for n in names))  # fmt: skip
        return samples

    async def _once(self, mode: Callable, seed: int, check: str | None = None) -> dict[str, float]:
        seq = Sequence.from_prompt(f"handoff-{seed}", random_prompt(PROMPT_TOKENS, seed))
        nbytes = self.num_prompt_blocks * self.layout.block_nbytes
        if check is not None:
            self.peer.ask("zero", nbytes)
        try:
            result = await mode(seq)
            if check is not None:
                local = hashlib.blake2b(digest_size=16)
                for b in self._blocks(seq):
                    start, n = self.engine.pool.block_range(b)
                    local.update(self.segment.view[start : start + n])
                if self.peer.ask("hash", 0, nbytes)["hash"] != local.hexdigest():
                    raise RuntimeError(f"hand-off {check}: the receiver's blocks differ from the prefill's")
            return result
        finally:
            self.engine.cache.free(seq)
