"""The prefill worker's use of the block store: fetch the prompt's stored prefix
blocks before computing, write new full blocks back after. The store is an
optimisation: when it is absent or refuses, the worker computes everything."""

from nats.errors import NoRespondersError, TimeoutError as NatsTimeout

from libs.common import subjects
from libs.common.engine_host import EngineHost
from libs.common.model.sequence import Sequence
from libs.common.schema import BadMessageError, StoreGetReply, StoreGetRequest, StorePutReply, StorePutRequest
from libs.common.service import Service

STORE_TIMEOUT = 5.0


class StoreClient:
    def __init__(self, service: Service, host: EngineHost) -> None:
        self.service = service
        self.host = host
        self.log = service.log
        self.hits = 0  # blocks fetched
        self.puts = 0  # blocks written back

    async def fetch_prefix(self, seq: Sequence) -> int:
        """Fill the prompt's next uncached full blocks from the store; return how many were found."""
        cache = self.host.engine.cache
        bs = cache.block_size
        first = seq.num_computed_tokens // bs
        usable = (seq.num_prompt_tokens - 1) // bs  # the last token is always computed
        if first >= usable:
            return 0
        hashes = cache.prompt_hashes(seq)[first:usable]
        blocks = seq.block_table[first:usable]
        request = StoreGetRequest(contract=self.host.contract, block_hashes=list(hashes), segment=self.host.segment.name,
                                  offsets=[self.host.block_offset(b) for b in blocks])  # fmt: skip
        reply = await self._call("get", request, StoreGetReply)
        found = reply.num_found if reply is not None else 0
        seq.num_computed_tokens += found * bs
        seq.num_cached_tokens += found * bs
        self.hits += found
        return found

    async def write_back(self, seq: Sequence) -> None:
        """Offer the prompt's full blocks that did not come from a cache to the store."""
        bs = self.host.engine.cache.block_size
        first = seq.num_cached_tokens // bs
        last = min(len(seq.block_hashes), seq.num_prompt_tokens // bs)
        if first >= last:
            return
        request = StorePutRequest(contract=self.host.contract, block_hashes=list(seq.block_hashes[first:last]),
                                  segment=self.host.segment.name,
                                  offsets=[self.host.block_offset(b) for b in seq.block_table[first:last]])  # fmt: skip
        reply = await self._call("put", request, StorePutReply)
        if reply is not None:
            self.puts += reply.num_stored

    async def _call(self, op: str, request, kind):
        try:
            reply = await self.service.request(subjects.store_op(op), request, kind, timeout=STORE_TIMEOUT)
        except NoRespondersError:
            return None  # no store in this cluster
        except (NatsTimeout, BadMessageError) as e:
            self.log.warning("store %s failed: %s", op, e)
            return None
        if reply.error is not None:
            self.log.warning("store refused %s: %s", op, reply.error.message)
            return None
        return reply
