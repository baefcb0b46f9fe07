"""Continuous batching, apart from any I/O: which sequences run each step, and
what a step's logits make of them.

A sequence goes waiting -> running -> finished. Waiting sequences need a
prefill: new ones, and preempted ones, whose blocks were taken back under KV
pressure and whose KV (prompt and every token generated so far) is recomputed
when they are admitted again. A step is either one prefill of everything
admitted or one decode step of the running batch. While sequences decode, a
prefill step computes at most ``max_chunk_tokens`` prompt tokens and prefill
and decode steps alternate (chunked prefill, as vLLM's, kept to whole steps): a
long prompt stalls the batch one chunk at a time, and stays waiting, its
blocks held, until its last chunk. The in-process `Generator`
and the decode worker both drive this class through `run_step`; they differ
only in how they decide a sequence stops (`Stop`) and where its tokens go.
Not thread-safe: a worker calls it on its engine thread alone.
"""

import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import torch

from libs.common.prefill_order import Work, plan
from libs.engine.model import steps
from libs.engine.model.engine import Engine
from libs.engine.model.grammar import GrammarCompiler
from libs.engine.model.kv_cache import KVCacheManager
from libs.engine.model.sampling import sample_sequences
from libs.engine.model.sequence import Sequence
from libs.engine.model.stopping import check_finish
from libs.protocol.ids import RequestId
from libs.protocol.schema import TokenLogprobs
from libs.protocol.vocabulary import FinishReason

# Whether the token just appended to a sequence ends it, and why.
Stop = Callable[[Sequence], FinishReason | None]


def token_stop(eos_token_ids: Collection[int], max_model_len: int) -> Stop:
    """The workers' rule: end-of-sequence and stop tokens, max_tokens, the context
    window (stop strings need text: the gateway applies those)."""
    return lambda seq: check_finish(seq, eos_token_ids, max_model_len)


@dataclass(frozen=True)
class TokenOutput:
    seq: Sequence
    token_id: int
    index: int  # position of this token among the sequence's generated tokens
    finish_reason: FinishReason | None
    logprobs: TokenLogprobs | None = None  # when its request asked for them

    @property
    def request_id(self) -> str:
        return self.seq.request_id


def sample_tokens(
    seqs: list[Sequence], logits: torch.Tensor, stop: Stop, eos_token_ids: Collection[int],
    grammars: GrammarCompiler | None = None,
) -> list[TokenOutput]:
    """Sample one token per sequence from ``logits`` ([B, V]), append it, and say
    whether it ends the sequence. The one sampling path of every engine loop
    (``eos_token_ids``: what min_tokens keeps a sequence from drawing; ``grammars``:
    what compiles a request's grammar). A grammar that has ended (its stop token
    came) ends its sequence too, ignore_eos or not."""
    outputs = []
    for seq, sampled in zip(seqs, sample_sequences(logits, seqs, eos_token_ids, grammars)):
        seq.append_token(sampled.token_id)
        finish = stop(seq)
        if finish is None and seq.grammar is not None and seq.grammar.is_terminated:
            finish = FinishReason.STOP
        outputs.append(TokenOutput(seq, sampled.token_id, seq.num_output_tokens - 1, finish, sampled.logprobs))
    return outputs


@dataclass
class Batch:
    """What one step runs: a prefill or a decode step of ``seqs``; a prefill step may
    also compute the next ``chunk`` of a prompt too long for it (the sequence and its
    tokens: no logits, it stays waiting)."""

    seqs: list[Sequence]
    is_prefill: bool
    chunk: tuple[Sequence, int] | None = None
    preempted: list[Sequence] = field(default_factory=list)  # moved back to waiting to make room
    rejected: list[Sequence] = field(default_factory=list)  # larger than the whole KV pool: finished (ABORT)


@dataclass
class StepResult:
    outputs: list[TokenOutput]
    preempted: list[Sequence]
    rejected: list[Sequence]
    computed: bool = False  # the step ran something (a chunk of a prompt counts, though it yields no token)


@dataclass(frozen=True)
class Due:
    """When a sequence to prefill is due (its TTFT deadline on the caller's clock; None:
    best effort) and when it came: such sequences are prefilled in the order of
    `libs/common/prefill_order.py`, a chunk per step."""

    deadline: float | None
    arrived: float


class StepFailed(Exception):
    """The engine failed a step; its sequences were finished (ABORT), their blocks freed."""

    def __init__(self, seqs: list[Sequence], cause: Exception) -> None:
        super().__init__(f"a step of {len(seqs)} sequences failed: {cause}")
        self.seqs = seqs


class Scheduler:
    def __init__(self, cache: KVCacheManager, stop: Stop, max_batch_size: int = 64,
                 prefill_time: Callable[[Sequence], float] | None = None,
                 eos_token_ids: Collection[int] = (), grammars: GrammarCompiler | None = None) -> None:  # fmt: skip
        self.cache = cache
        self.stop = stop
        self.eos_token_ids = eos_token_ids  # masked while a sequence is short of its min_tokens
        self.grammars = grammars  # compiles the requests' grammars (None: no request may have one)
        self.max_batch_size = max_batch_size
        # predicted seconds of prefill a sequence has left (ordering sequences added with a Due)
        self.prefill_time = prefill_time or (lambda seq: 1e-3 * (seq.num_tokens - seq.num_computed_tokens))
        self.due: dict[str, Due] = {}
        self.waiting: deque[Sequence] = deque()  # to prefill, oldest first
        self.running: list[Sequence] = []  # KV computed up to their last token, oldest first
        self.partial: Sequence | None = None  # waiting with its blocks allocated and its prompt partly computed
        self._decode_next = False  # a prefill step ran while the batch was decoding: a decode step is due

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_requests(self) -> int:
        return len(self.running) + len(self.waiting)

    def add(self, seq: Sequence, due: Due | None = None) -> None:
        """A new sequence: it waits for room, then is prefilled (reusing cached prefix blocks).
        With ``due``, it is prefilled in deadline order with the others that have one, after
        any without (sequences preempted to be recomputed, and every one of `kvserve chat`)."""
        self.waiting.append(seq)
        if due is not None:
            self.due[seq.request_id] = due

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose KV was computed elsewhere (a hand-off) and which holds
        its blocks: it joins the decode batch at once."""
        self.running.append(seq)

    def abort(self, request_id: RequestId) -> Sequence | None:
        """Finish a request's sequences where they stand and free their blocks; the first
        of them, or None if none is here."""
        found = [seq for seq in [*self.waiting, *self.running] if seq.request_id == request_id]
        for seq in found:
            self.finish(seq, FinishReason.ABORT)
        return found[0] if found else None

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.finish_reason = reason
        self.due.pop(seq.request_id, None)
        if seq is self.partial:
            self.partial = None
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.cache.free(seq)

    def schedule(self, max_chunk_tokens: int | None = None, now: float | None = None) -> Batch:
        """Admit what fits (a prefill step) or else decode the running batch,
        preempting the newest sequences until that step's blocks fit. With
        ``max_chunk_tokens`` and a batch decoding, the prefill takes at most that many
        prompt tokens and the next step decodes. Sequences added with a Due are
        prefilled a chunk per step even with no batch decoding, in deadline order
        (``now`` on their clock, else ``time.monotonic()``): a short one that arrives
        behind a long one waits a step, not the whole long prompt."""
        rejected: list[Sequence] = []
        ordered = self._reorder(time.monotonic() if now is None else now)
        budget = max_chunk_tokens if self.running or ordered else None
        if budget is None or not self._decode_next:
            admitted, chunk = self._admit(rejected, budget, ordered)
            if admitted or chunk is not None:
                self._decode_next = budget is not None and bool(self.running)
                return Batch(admitted, is_prefill=True, chunk=chunk, rejected=rejected)
        self._decode_next = False
        preempted: list[Sequence] = []
        batch = self._decode_batch(preempted, rejected)
        return Batch(batch, is_prefill=False, preempted=preempted, rejected=rejected)

    def update(self, batch: Batch, logits: torch.Tensor) -> list[TokenOutput]:
        """Sample the step's tokens; prefilled sequences join the running batch,
        finished ones leave it and free their blocks."""
        outputs = sample_tokens(batch.seqs, logits, self.stop, self.eos_token_ids, self.grammars)
        for out in outputs:
            if batch.is_prefill:
                self.running.append(out.seq)
            if out.finish_reason is not None:
                self.finish(out.seq, out.finish_reason)
        return outputs

    def _reorder(self, now: float) -> list[Sequence]:
        """Put the waiting sequences with a Due in plan order, behind the others (the
        partly prefilled one stays at the head); return, in plan order, those the plan
        puts ahead of the partly prefilled one (or all of them, without one)."""
        ordered = [s for s in self.waiting if s.request_id in self.due and s is not self.partial]
        if not ordered:
            return []
        work = [Work(i, self.prefill_time(s), self.due[s.request_id].deadline, self.due[s.request_id].arrived)
                for i, s in enumerate(ordered)]  # fmt: skip
        partial = self.partial if self.partial is not None and self.partial.request_id in self.due else None
        if partial is not None:
            d = self.due[partial.request_id]
            work.append(Work(-1, self.prefill_time(partial), d.deadline, d.arrived))
        order = [w.key for w in plan(work, now)]
        keep = [s for s in self.waiting if s.request_id not in self.due or s is self.partial]
        self.waiting = deque(keep + [ordered[i] for i in order if i >= 0])
        if partial is None:
            return [ordered[i] for i in order if i >= 0]
        return [ordered[i] for i in order[: order.index(-1)]]

    def _admit(
        self, rejected: list[Sequence], budget: int | None, ahead: list[Sequence] | None = None
    ) -> tuple[list[Sequence], tuple[Sequence, int] | None]:
        """The waiting sequences this prefill step completes, oldest first, and the chunk
        of the next one's prompt it computes within ``budget`` tokens (None: no limit).
        ``ahead``: sequences the deadline order puts before a partly prefilled one, which
        this step completes first when they fit it whole."""
        cache, admitted = self.cache, []
        if self.partial is not None and budget is not None:
            for seq in ahead or []:
                if len(self.running) + len(admitted) >= self.max_batch_size or budget <= 0:
                    break
                if not self._can_ever_fit(seq):
                    continue
                cache.match_prefix(seq)
                headroom = (len(self.running) + len(admitted)) * cache.block_size + self._fork_room(seq)
                left = seq.num_tokens - seq.num_computed_tokens
                if left > budget or not cache.can_allocate(seq, seq.num_tokens + headroom):
                    self._reset(seq)  # it would be a second partial one, or it does not fit now
                    continue
                cache.allocate(seq, seq.num_tokens)
                budget -= left
                self.waiting.remove(seq)
                admitted.append(seq)
        while self.waiting and len(self.running) + len(admitted) < self.max_batch_size:
            if budget == 0:
                break  # before any allocation: a partial one keeps its blocks and computed KV, a new one takes none
            seq = self.waiting[0]
            if seq is not self.partial:  # a partial one holds its blocks already
                if not self._can_ever_fit(seq):
                    self.finish(seq, FinishReason.ABORT)
                    rejected.append(seq)
                    continue
                cache.match_prefix(seq)
                # leave one block of headroom per running sequence for its next decode steps
                headroom = (len(self.running) + len(admitted)) * cache.block_size + self._fork_room(seq)
                if not cache.can_allocate(seq, seq.num_tokens + headroom):
                    self._reset(seq)  # gives back the prefix blocks just matched
                    break
                cache.allocate(seq, seq.num_tokens)
            left = seq.num_tokens - seq.num_computed_tokens
            if budget is not None and left > budget:
                self.partial = seq
                return admitted, (seq, budget)
            if budget is not None:
                budget -= left
            if seq is self.partial:
                self.partial = None
            admitted.append(self.waiting.popleft())
        return admitted, None

    def _decode_batch(self, preempted: list[Sequence], rejected: list[Sequence]) -> list[Sequence]:
        cache = self.cache
        while self.running:
            batch = self.running[: self.max_batch_size]
            needed = sum(cache.blocks_needed(s.num_tokens) - len(s.block_table) for s in batch)
            if cache.can_allocate_blocks(needed):
                return batch
            victim = self.running[-1]  # the newest: it has the least work to lose
            if len(self.running) == 1 and not self._can_ever_fit(victim):
                self.finish(victim, FinishReason.ABORT)
                rejected.append(victim)
                continue
            self.running.pop()
            self._reset(victim)
            # first in line again, but behind a partly prefilled sequence: that one holds
            # its blocks and must stay at the head (``partial`` names only the head)
            self.waiting.insert(0 if self.partial is None else 1, victim)
            preempted.append(victim)
        return []

    def _fork_room(self, seq: Sequence) -> int:
        """Tokens of room the other sequences of a request for n > 1 take when they fork
        after its prefill (`fan_out`): a copy of its last, partly filled block each."""
        return (seq.params.n - 1) * self.cache.block_size if seq.num_output_tokens == 0 else 0

    def _can_ever_fit(self, seq: Sequence) -> bool:
        return self.cache.blocks_needed(seq.num_tokens) <= self.cache.num_blocks

    def _reset(self, seq: Sequence) -> None:
        """Forget a sequence's KV (recomputed on admission): recompute, not swap."""
        self.cache.free(seq)
        seq.num_computed_tokens = seq.num_cached_tokens = 0
        seq.block_hashes = []


def run_step(engine: Engine, scheduler: Scheduler) -> StepResult:
    """Schedule one step, allocate its sequences' blocks, run it on the engine (a
    prefill in chunks of at most ``max_chunk_tokens``), and account for its tokens: the
    whole of an engine loop's iteration (blocking: a worker runs it on its engine thread)."""
    batch = scheduler.schedule(engine.config.max_chunk_tokens)
    ran = batch.seqs + ([batch.chunk[0]] if batch.chunk is not None else [])
    if not ran:
        return StepResult([], batch.preempted, batch.rejected)
    for seq in batch.seqs if batch.is_prefill else []:
        scheduler.due.pop(seq.request_id, None)  # prefilled: no longer ordered
    try:
        steps.allocate(engine, ran)  # room for them is what schedule() checked
        if batch.chunk is not None:
            engine.prefill_chunk([batch.chunk])  # short of its last token: no logits
        logits = None
        if batch.seqs:
            logits = steps.prefill(engine, batch.seqs) if batch.is_prefill else engine.decode_step(batch.seqs)
        if logits is not None and batch.is_prefill:
            logits = fan_out(engine, batch, logits)
            ran = batch.seqs + ([batch.chunk[0]] if batch.chunk is not None else [])  # with the forked ones
    except Exception as e:
        for seq in ran:  # their KV is in an unknown state
            scheduler.finish(seq, FinishReason.ABORT)
        raise StepFailed(ran, e) from e
    outputs = scheduler.update(batch, logits) if logits is not None else []
    return StepResult(outputs, batch.preempted, batch.rejected, computed=True)


def fan_out(engine: Engine, batch: Batch, logits: torch.Tensor) -> torch.Tensor:
    """A request that asks for n sequences is prefilled once; after its prefill, its
    n - 1 other sequences fork from it, sharing its prompt's KV blocks, and join the
    step with a copy of its logits row (each samples its own first token). Returns
    the step's logits, one row per sequence of ``batch.seqs`` as it now is."""
    rows, seqs, forks = [], [], []
    try:
        for row, seq in enumerate(batch.seqs):
            rows.append(row)
            seqs.append(seq)
            if seq.params.n > 1 and seq.choice == 0 and seq.num_output_tokens == 0:  # prefilled for the first time
                for choice in range(1, seq.params.n):
                    forks.append(engine.fork(seq, choice))
                    seqs.append(forks[-1])
                    rows.append(row)
    except Exception:
        for fork in forks:  # nothing else knows of them yet
            engine.cache.free(fork)
        raise
    if len(seqs) == len(batch.seqs):
        return logits
    batch.seqs = seqs
    return logits[torch.tensor(rows, device=logits.device)]
