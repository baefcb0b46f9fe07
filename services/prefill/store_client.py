"""The prefill worker's use of the sharded block store: fetch the prompt's stored
prefix blocks before computing, write new full blocks back after.

Stores are learnt from their heartbeats (a store whose KV contract differs is
left out, and said so once); a consistent-hash ring over the live ones says
which ``replicas`` instances own each block: writes go to all of them, reads
take the fastest tier any of them reports. Bytes move through the transfer
engine: a get writes into a ticket this worker issues for its own blocks, a
put writes into the ticket the store issues for fresh slots, then commits.
The store is an optimisation: when it is absent, slow or refuses, the worker
computes everything.
"""

import asyncio
import time
from collections.abc import Awaitable
from typing import TypeVar

from nats.aio.msg import Msg

from libs.common import store_client
from libs.common.hash_ring import HashRing
from libs.common.peers import PeerDirectory
from libs.common.service import Service
from libs.engine.cost_model import CostModel
from libs.engine.engine_host import EngineHost
from libs.engine.model.sequence import Sequence
from libs.protocol.schema import CacheOwner, CostCoefficients, Heartbeat, WriteTicket
from libs.protocol.vocabulary import KVTier, Role
from libs.transfer import Descriptor, Span, TransferError
from services.prefill.fetch_policy import FetchPolicy

STORE_TIMEOUT = 5.0
T = TypeVar("T")
_TIER_RANK = {KVTier.DRAM: 0, KVTier.DISK: 1}


class StoreClient:
    def __init__(self, service: Service, host: EngineHost, replicas: int = 1, policy: FetchPolicy | None = None) -> None:
        self.service = service
        self.host = host
        self.log = service.log
        self.replicas = replicas
        self.policy = policy or FetchPolicy(host.engine.cache.block_size)
        self.stores = PeerDirectory()
        service.heard_views.append(self.stores)
        self.calls: store_client.StoreClient | None = None  # once connected
        self._ring = HashRing()
        self._refused: set[str] = set()  # stores whose contract differs (logged once)
        # stores whose last call failed (dead, restarting, or cut off): passed over until
        # heard from after it, so one death stalls one call per request in flight, not all of them
        self._failed_at: dict[str, float] = {}
        self.hits = 0  # blocks fetched
        self.puts = 0  # blocks the stores did not have and now do

    async def start(self, cost: CostCoefficients | None = None) -> None:
        """Watch the stores' heartbeats; ``cost``: the worker's calibrated cost model, if any."""
        if cost is not None:
            self.policy.cost = CostModel(cost)
        self.calls = store_client.StoreClient(self.service.nc, self.host.contract, STORE_TIMEOUT)
        await self.service.subscribe_heartbeats(Role.STORE, self.on_heartbeat)

    async def on_heartbeat(self, heartbeat: Heartbeat, msg: Msg) -> None:
        mismatch = heartbeat.contract and self.host.contract.mismatch(heartbeat.contract)
        if mismatch or heartbeat.contract is None:
            if heartbeat.instance_id not in self._refused:
                self._refused.add(heartbeat.instance_id)
                self.log.warning("not using store %s: %s", heartbeat.instance_id, mismatch or "it declares no contract")
            return
        self.stores.observe(heartbeat)

    def ring(self) -> HashRing:
        """The ring over the stores alive now and not passed over (rebuilt only when they change)."""
        alive = sorted(hb.instance_id for hb in self.stores.alive(Role.STORE) if not self._passed_over(hb.instance_id))
        if alive != self._ring.members:
            self._ring = HashRing(alive)
        return self._ring

    # --- reads --------------------------------------------------------------------------
    async def fetch_prefix(self, seq: Sequence) -> dict[str, int]:
        """Fill the prompt's next uncached full blocks from the stores, when loading is
        predicted faster than computing them; return the tokens fetched, by the tier
        they came from."""
        bs = self.host.engine.cache.block_size
        first = seq.num_computed_tokens // bs
        usable = (seq.num_prompt_tokens - 1) // bs  # the last token is always computed
        ring = self.ring()
        if first >= usable or not len(ring):
            return {}
        hashes = self.host.engine.cache.prompt_hashes(seq)[first:usable]
        holders = await self._locate(ring, hashes)
        run = next((i for i, held in enumerate(holders) if held is None), len(holders))
        count = self.policy.blocks_worth_loading([held[1] for held in holders[:run]], first * bs, seq.num_prompt_tokens)
        if count == 0:
            return {}
        started = time.perf_counter()
        found = await self._get(hashes[:count], holders[:count], seq.block_table[first : first + count])
        got = next((i for i, tier in enumerate(found) if tier is None), len(found))
        self.policy.observe_load(found[:got], time.perf_counter() - started)
        seq.num_computed_tokens += got * bs
        seq.num_cached_tokens += got * bs
        self.hits += got
        fetched: dict[str, int] = {}
        for tier in found[:got]:
            fetched[tier] = fetched.get(tier, 0) + bs
        return fetched

    async def _locate(self, ring: HashRing, hashes: list[bytes]) -> list[tuple[str, str] | None]:
        """For each block: (store, tier) of its fastest copy among its owners, or None."""
        owners = [ring.owners(h, self.replicas) for h in hashes]
        asks: dict[str, list[int]] = {}
        for i, names in enumerate(owners):
            for name in names:
                asks.setdefault(name, []).append(i)
        replies = await asyncio.gather(*(self._call(name, self.calls.exists(name, [hashes[i] for i in idx]))
                                         for name, idx in asks.items()))  # fmt: skip
        best: list[tuple[str, str] | None] = [None] * len(hashes)
        for (name, idx), tiers in zip(asks.items(), replies):
            if tiers is None:
                continue
            for i, tier in zip(idx, tiers):
                if tier is None:
                    continue
                current = best[i]
                better = current is None or _TIER_RANK[tier] < _TIER_RANK[current[1]] or (
                    _TIER_RANK[tier] == _TIER_RANK[current[1]] and owners[i].index(name) < owners[i].index(current[0]))
                if better:
                    best[i] = (name, tier)
        return best

    async def _get(self, hashes: list[bytes], holders: list[tuple[str, str]], blocks: list[int]) -> list[str | None]:
        """Ask each holder for its blocks, written straight into ``blocks``; the tier each came from."""
        nbytes = self.host.block_nbytes
        by_store: dict[str, list[int]] = {}
        for i, (name, _) in enumerate(holders):
            by_store.setdefault(name, []).append(i)
        found: list[str | None] = [None] * len(hashes)

        async def ask(name: str, idx: list[int]) -> None:
            offsets = [self.host.block_offset(blocks[i]) for i in idx]
            ticket = self.host.transfers.expect(self.host.segment.name, [(o, nbytes) for o in offsets], STORE_TIMEOUT,
                                                sender_host=self._host_of(name))  # fmt: skip
            try:
                tiers = await self._call(name, self.calls.get(name, [hashes[i] for i in idx], nbytes, ticket, offsets))
            finally:
                self.host.transfers.close_ticket(ticket.token)
            if tiers is not None:
                for i, tier in zip(idx, tiers):
                    found[i] = tier

        await asyncio.gather(*(ask(name, idx) for name, idx in by_store.items()))
        return found

    # --- writes -------------------------------------------------------------------------
    async def write_back(self, seq: Sequence, owner: CacheOwner | None = None) -> None:
        """Offer the prompt's full blocks to the stores that own them; each store takes
        the ones it lacks, counted as ``owner``'s. The caller holds the blocks until this returns."""
        bs = self.host.engine.cache.block_size
        last = min(len(seq.block_hashes), seq.num_prompt_tokens // bs)
        ring = self.ring()
        if last == 0 or not len(ring):
            return
        by_store: dict[str, list[int]] = {}
        for i, h in enumerate(seq.block_hashes[:last]):
            for name in ring.owners(h, self.replicas):
                by_store.setdefault(name, []).append(i)
        await asyncio.gather(*(self._put(name, [seq.block_hashes[i] for i in idx], [seq.block_table[i] for i in idx],
                                         owner)
                               for name, idx in by_store.items()))  # fmt: skip

    async def _put(self, name: str, hashes: list[bytes], blocks: list[int], owner: CacheOwner | None = None) -> None:
        reply = await self._call(name, self.calls.put(name, hashes, self.host.block_nbytes,
                                                host_id=self.host.transfers.writer_host_id, owner=owner))  # fmt: skip
        if reply is None or not reply.missing:
            return
        spans = [Span(self.host.block_offset(blocks[i]), offset, self.host.block_nbytes)
                 for i, offset in zip(reply.missing, reply.offsets)]  # fmt: skip
        try:
            await self._write(reply.ticket, spans)
        except TransferError as e:
            self.log.warning("put to store %s failed: %s", name, e)
            return  # uncommitted: the store frees the slots when the ticket expires
        num_stored = await self._call(name, self.calls.commit(name, reply.put_id))
        if num_stored is not None:
            self.puts += num_stored

    async def _write(self, ticket: WriteTicket, spans: list[Span]) -> None:
        """Into the store's fresh slots: a plain copy between mapped segments on this
        host, a TCP transfer otherwise; either way off the event loop."""
        transfers = self.host.transfers
        loop = asyncio.get_running_loop()
        if transfers.choose_transport(ticket) == "shm":
            transfers.claim(ticket)  # no TCP writer may use it too
            source = self.host.segment.name
            batch = [Descriptor(source, s.src_offset, ticket.segment, s.dst_offset, s.length) for s in spans]
            await loop.run_in_executor(None, transfers.copy, batch)
            return
        writer = await loop.run_in_executor(None, transfers.writer, ticket, self.host.segment.name, STORE_TIMEOUT)
        writer.submit(spans)
        await transfers.finish(writer)

    def _host_of(self, name: str) -> str | None:
        """A store's host id, from its heartbeat: whether its writes to us can come over TCP."""
        return next((hb.host_id for hb in self.stores.alive(Role.STORE) if hb.instance_id == name), None)

    async def _call(self, name: str, call: Awaitable[T]) -> T | None:
        """A store call's result, or None when it failed (logged): the store is an optimisation.
        A store that failed to answer is passed over until it is heard from again."""
        asked_at = self.stores.now()
        try:
            return await call
        except store_client.StoreError as e:
            if not e.refused:
                first = not self._passed_over(name)
                self._failed_at[name] = asked_at
                if first:
                    self.log.warning("%s (failed); passing store %s over until it is heard from again", e, name)
                return None
            self.log.warning("%s (refused)", e)
            return None

    def _passed_over(self, name: str) -> bool:
        failed_at = self._failed_at.get(name)
        if failed_at is None:
            return False
        heard = self.stores.last_heard(name)
        if heard is not None and heard[1] > failed_at:
            del self._failed_at[name]
            return False
        return True
