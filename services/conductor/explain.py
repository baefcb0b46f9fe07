"""What the console shows of the conductor: its last routing decisions, each with
what it predicted on every candidate, the prompt prefixes reused most and where
their copies are, and the KV index counted per instance and tier.

`DecisionLog.record` is called between a policy's choice and the booking of its
load (`Admitter.explain`), so every candidate's numbers are the ones the policy
weighed. Predicting every candidate again costs about as much as the choice
itself, so a decision keeps its candidates only while a console watches (asked
for a view in the last WATCHED_S seconds). Only the live conductor keeps a log;
the simulator does not pay for it.
"""

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable

from libs.protocol.ids import InstanceId
from libs.protocol.schema import CandidateView, ConductorViewReply, DecisionView, PrefixView
from libs.protocol.slo import SLO
from libs.protocol.vocabulary import Role
from services.conductor.index import KVIndex
from services.conductor.predict import AdmitContext
from services.conductor.routers import Decision

MAX_DECISIONS = 200
MAX_PREFIXES = 4096  # reused prefixes counted; the least recently reused is forgotten first
WATCHED_S = 10.0  # after a view was asked for, decisions keep their candidates this long


class DecisionLog:
    def __init__(
        self, policy: str, max_decisions: int = MAX_DECISIONS, clock: Callable[[], float] = time.time
    ) -> None:
        self.policy = policy
        self.clock = clock
        self._decisions: deque[DecisionView] = deque(maxlen=max_decisions)
        self._prefixes: OrderedDict[Hashable, list[int]] = OrderedDict()  # last block -> [hits, blocks]
        self._watched_until = float("-inf")

    def record(self, ctx: AdmitContext, decision: Decision) -> None:
        request = ctx.request
        candidates = []
        if self.clock() < self._watched_until:
            candidates = [self._prefill_candidate(ctx, p) for p in ctx.prefills]
            candidates += [self._decode_candidate(ctx, d) for d in ctx.decodes]
        self._decisions.append(DecisionView(
            request_id=request.request_id, at=self.clock(), policy=self.policy,
            prefill_id=decision.prefill_id, decode_id=decision.decode_id,
            prefill_on_decode=decision.prefill_on_decode, predicted_ttft_s=decision.predicted_ttft_s,
            predicted_tbt_s=decision.predicted_tbt_s, cached_tokens=dict(decision.cached_tokens),
            candidates=candidates, rejected=None if decision.admitted else (decision.reason or decision.error_code),
            why=decision.error_message, affinity=decision.affinity,
        ))  # fmt: skip
        reused = max(ctx.match.prefix.values(), default=0)
        if reused:
            self._count_prefix(request.block_hashes[reused - 1], reused)

    @staticmethod
    def _prefill_candidate(ctx: AdmitContext, p) -> CandidateView:
        e = ctx.prefill_estimate(p)
        return CandidateView(instance_id=p.instance_id, role=Role.PREFILL, predicted_ttft_s=e.ttft_s,
                             queue_s=e.queue_s, cached_tokens=sum(e.cached_tokens.values()))  # fmt: skip

    @staticmethod
    def _decode_candidate(ctx: AdmitContext, d) -> CandidateView:
        e = ctx.decode_all(d)
        return CandidateView(instance_id=d.instance_id, role=Role.DECODE, predicted_tbt_s=e.tbt_s,
                             batch_size=e.batch_size)  # fmt: skip

    def _count_prefix(self, last_block: Hashable, num_blocks: int) -> None:
        counted = self._prefixes.get(last_block)
        if counted is None:
            counted = self._prefixes[last_block] = [0, num_blocks]
            if len(self._prefixes) > MAX_PREFIXES:
                self._prefixes.popitem(last=False)
        counted[0] += 1
        self._prefixes.move_to_end(last_block)

    def decisions(self, limit: int) -> list[DecisionView]:
        """The last ``limit`` decisions, newest first."""
        newest = list(reversed(self._decisions))
        return newest[: max(limit, 0)]

    def hot_prefixes(self, index: KVIndex, limit: int) -> list[PrefixView]:
        """The ``limit`` prefixes reused most, with the instances holding their last block now."""
        ranked = sorted(self._prefixes.items(), key=lambda item: -item[1][0])[: max(limit, 0)]
        out = []
        for block, (hits, num_blocks) in ranked:
            match = index.match([block])
            holders = {i: match.tiers(i, 0, 1)[0] for i in sorted(match.prefix)}
            name = block.hex() if isinstance(block, bytes) else str(block)
            out.append(PrefixView(block_hash=name, num_blocks=num_blocks, hits=hits, holders=holders))
        return out

    def view(self, instance_id: InstanceId, index: KVIndex, slo: SLO, max_decisions: int, max_prefixes: int) -> ConductorViewReply:
        """What the console shows; decisions keep their candidates for the next WATCHED_S seconds."""
        self._watched_until = self.clock() + WATCHED_S
        blocks = {i: {tier: len(held) for tier, held in index.contents(i).items()} for i in index.instances()}
        return ConductorViewReply(
            instance_id=instance_id, policy=self.policy, slo_ttft_s=slo.ttft_s, slo_tbt_s=slo.tbt_s, blocks=blocks,
            hot_prefixes=self.hot_prefixes(index, max_prefixes), decisions=self.decisions(max_decisions),
        )  # fmt: skip
