"""Generation in one process: a loop over the scheduler and the engine.

Each ``step`` is one `run_step` of `scheduler.py` (a prefill of the requests
that fit, or a decode step of the running batch), with text and stop strings
applied by each request's `StopChecker`. The decode worker runs the same
scheduler, so this is the reference the disaggregated cluster must match token
for token, and what `kvserve chat` and the benchmarks run.
"""

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from libs.common.errors import OutOfKVBlocksError
from libs.common.model.engine import Engine
from libs.common.model.scheduler import Scheduler, StepFailed, run_step
from libs.common.model.sequence import Sequence
from libs.common.model.stopping import StopChecker
from libs.common.model.tokenizer import Tokenizer
from libs.common.sampling_params import SamplingParams
from libs.common.schema import TokenLogprobs
from libs.common.vocabulary import FinishReason


@dataclass
class StepOutput:
    request_id: str
    token_id: int
    text: str  # newly visible text
    finish_reason: FinishReason | None
    logprobs: TokenLogprobs | None = None  # when the request asked for them


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
        self.scheduler = Scheduler(engine.cache, self._stop, max_batch_size, eos_token_ids=tokenizer.eos_token_ids)
        self._stops: dict[str, StopChecker] = {}
        self._deltas: dict[str, str] = {}  # the text each request's latest token made visible
        self._ids = itertools.count()

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> Sequence:
        params.validate(self.engine.model.config.vocab_size)
        self.engine.check_prompt(len(prompt_ids))
        seq = Sequence.from_prompt(request_id or f"req-{next(self._ids)}", prompt_ids, params)
        self._stops[seq.request_id] = StopChecker(
            self.tokenizer, params, self.engine.max_model_len, seq.num_prompt_tokens
        )
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    def step(self) -> list[StepOutput]:
        try:
            result = run_step(self.engine, self.scheduler)
        except StepFailed as e:
            raise e.__cause__  # the engine's own error: nothing here to report it to but the caller
        if result.rejected:  # it cannot fit even alone
            cache = self.engine.cache
            raise OutOfKVBlocksError(cache.blocks_needed(result.rejected[0].num_tokens), cache.num_free_blocks)
        return [
            StepOutput(out.request_id, out.token_id, self._deltas.pop(out.request_id), out.finish_reason, out.logprobs)
            for out in result.outputs
        ]

    def _stop(self, seq: Sequence) -> FinishReason | None:
        stop = self._stops[seq.request_id]
        self._deltas[seq.request_id] = stop.add(seq.token_ids[-1])
        return stop.finish_reason

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

