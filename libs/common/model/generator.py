"""Generation in one process: a continuous-batching loop over the engine.

Each ``step`` admits waiting requests (one prefill for all that fit the free
blocks) or, when none wait, runs one decode step for every running sequence.
This is the reference the disaggregated cluster must match token for token,
and what `kvserve chat` and the benchmarks run.
"""

import itertools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from libs.common.errors import OutOfKVBlocksError
from libs.common.model.engine import Engine
from libs.common.model.sampling import sample
from libs.common.model.sequence import Sequence
from libs.common.model.stopping import StopChecker
from libs.common.model.tokenizer import Tokenizer
from libs.common.sampling_params import SamplingParams
from libs.common.vocabulary import FinishReason


@dataclass
class StepOutput:
    request_id: str
    token_id: int
    text: str  # newly visible text
    finish_reason: FinishReason | None


@dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    num_cached_tokens: int


class Generator:
    def __init__(self, engine: Engine, tokenizer: Tokenizer, max_batch_size: int = 64) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._stops: dict[str, StopChecker] = {}
        self._ids = itertools.count()

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> Sequence:
        params.validate()
        self.engine.check_prompt(len(prompt_ids))
        seq = Sequence.from_prompt(request_id or f"req-{next(self._ids)}", prompt_ids, params)
        self._stops[seq.request_id] = StopChecker(
            self.tokenizer, params, self.engine.max_model_len, seq.num_prompt_tokens
        )
        self.waiting.append(seq)
        return seq

    def abort(self, request_id: str) -> None:
        for seq in [*self.waiting, *self.running]:
            if seq.request_id == request_id:
                self._finish(seq, FinishReason.ABORT)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[StepOutput]:
        admitted = self._admit()
        if admitted:
            return self._sample(admitted, self.engine.prefill(admitted))
        if not self.running:
            return []
        batch = self.running[: self.max_batch_size]
        self._make_room(batch)
        batch = [s for s in batch if s in self.running]
        return self._sample(batch, self.engine.decode_step(batch))

    def _admit(self) -> list[Sequence]:
        cache, admitted = self.engine.cache, []
        while self.waiting and len(self.running) + len(admitted) < self.max_batch_size:
            seq = self.waiting[0]
            cache.match_prefix(seq)
            # leave one block of headroom per running sequence for its next decode steps
            headroom = (len(self.running) + len(admitted)) * cache.block_size
            if not cache.can_allocate(seq, seq.num_tokens + headroom):
                self._reset(seq)
                if not self.running and not admitted:  # it cannot fit even alone
                    self.waiting.popleft()
                    raise OutOfKVBlocksError(cache.blocks_needed(seq.num_tokens), cache.num_free_blocks)
                break
            cache.allocate(seq, seq.num_tokens)
            admitted.append(self.waiting.popleft())
        return admitted

    def _make_room(self, batch: list[Sequence]) -> None:
        """Preempt the newest sequences (recomputed later) until this step's blocks fit."""
        cache = self.engine.cache
        while True:
            needed = sum(cache.blocks_needed(s.num_tokens) - len(s.block_table) for s in batch if s in self.running)
            if cache.block_pool.can_allocate(needed) or len(self.running) == 1:
                return
            victim = self.running.pop()
            self._reset(victim)
            self.waiting.appendleft(victim)

    def _reset(self, seq: Sequence) -> None:
        self.engine.cache.free(seq)
        seq.num_computed_tokens = seq.num_cached_tokens = 0
        seq.block_hashes = []

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[StepOutput]:
        tokens = sample(logits, [s.params for s in seqs], [s.num_output_tokens for s in seqs])
        outputs = []
        for seq, token in zip(seqs, tokens):
            seq.append_token(token)
            stop = self._stops[seq.request_id]
            text = stop.add(token)
            if seq not in self.running:
                self.running.append(seq)
            if stop.finish_reason is not None:
                self._finish(seq, stop.finish_reason)
            outputs.append(StepOutput(seq.request_id, token, text, stop.finish_reason))
        return outputs

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.engine.cache.free(seq)

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[StepOutput]:
        """Generate one request alone, yielding each token as it comes."""
        seq = self.add_request(prompt_ids, params)
        try:
            while not seq.is_finished:
                for out in self.step():
                    if out.request_id == seq.request_id:
                        yield out
        finally:
            if not seq.is_finished:
                self.abort(seq.request_id)
            self._stops.pop(seq.request_id, None)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Completion]:
        """Run a batch of prompts to completion with continuous batching."""
        all_params = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, all_params)]
        while self.has_work:
            self.step()
        return [
            Completion(s.request_id, s.prompt_token_ids, s.output_token_ids, self._stops.pop(s.request_id).text,
                       s.finish_reason, s.num_cached_tokens)  # fmt: skip
            for s in seqs
        ]

