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

from libs.engine.model.engine import Engine
from libs.engine.model.grammar import GrammarCompiler
from libs.engine.model.scheduler import Scheduler, StepFailed, run_step
from libs.engine.model.sequence import Sequence
from libs.engine.model.stopping import StopChecker
from libs.engine.model.tokenizer import Tokenizer
from libs.protocol.errors import OutOfKVBlocksError
from libs.protocol.ids import RequestId
from libs.protocol.sampling_params import SamplingParams
from libs.protocol.schema import TokenLogprobs
from libs.protocol.vocabulary import FinishReason


@dataclass
class StepOutput:
    request_id: RequestId
    token_id: int
    text: str  # newly visible text
    finish_reason: FinishReason | None
    logprobs: TokenLogprobs | None = None  # when the request asked for them
    choice: int = 0  # which of the request's n sequences


@dataclass
class Completion:
    request_id: RequestId
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    num_cached_tokens: int
    choice: int = 0  # which of the request's n sequences


class Generator:
    def __init__(self, engine: Engine, tokenizer: Tokenizer, max_batch_size: int = 64) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.grammars = GrammarCompiler(tokenizer, engine.model.config.vocab_size)
        self.scheduler = Scheduler(engine.cache, self._stop, max_batch_size, eos_token_ids=tokenizer.eos_token_ids,
                                   grammars=self.grammars)  # fmt: skip
        self._stops: dict[tuple[str, int], StopChecker] = {}  # by (request id, choice)
        self._deltas: dict[tuple[str, int], str] = {}  # the text each sequence's latest token made visible
        self._choices: dict[str, list[Sequence]] = {}  # a request's sequences, by choice
        self._ids = itertools.count()

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, request_id: RequestId | None = None
    ) -> Sequence:
        params.validate(self.engine.model.config.vocab_size)
        if params.grammar is not None:
            self.grammars.compile(params.grammar)  # an invalid schema is refused here, not mid-step
        self.engine.check_prompt(len(prompt_ids))
        seq = Sequence.from_prompt(request_id or f"req-{next(self._ids)}", prompt_ids, params)
        self._choices[seq.request_id] = [seq]
        self._stops[(seq.request_id, 0)] = self._stop_checker(seq)
        self.scheduler.add(seq)
        return seq

    def choices(self, request_id: RequestId) -> list[Sequence]:
        """A request's sequences, by choice (its n - 1 others once its prefill has run)."""
        return self._choices[request_id]

    def abort(self, request_id: RequestId) -> None:
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
            StepOutput(out.request_id, out.token_id, self._deltas.pop((out.request_id, out.seq.choice)),
                       out.finish_reason, out.logprobs, out.seq.choice)  # fmt: skip
            for out in result.outputs
        ]

    def _stop(self, seq: Sequence) -> FinishReason | None:
        key = (seq.request_id, seq.choice)
        stop = self._stops.get(key)
        if stop is None:  # the first token of another of the request's sequences
            stop = self._stops[key] = self._stop_checker(seq)
            self._choices[seq.request_id].append(seq)
        self._deltas[key] = stop.add(seq.token_ids[-1])
        return stop.finish_reason

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[StepOutput]:
        """Generate one request alone, yielding each token as it comes."""
        seq = self.add_request(prompt_ids, params)
        try:
            while not seq.is_finished:
                for out in self.step():
                    if out.request_id == seq.request_id and out.choice == 0:
                        yield out
        finally:
            if not seq.is_finished:
                self.abort(seq.request_id)
            self._forget(seq.request_id)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Completion]:
        """Run a batch of prompts to completion with continuous batching: each prompt's
        n completions in turn (one for n = 1)."""
        all_params = params if isinstance(params, list) else [params] * len(prompts)
        request_ids = [self.add_request(p, sp).request_id for p, sp in zip(prompts, all_params)]
        while self.has_work:
            self.step()
        completions = []
        for request_id in request_ids:
            for s in self._choices[request_id]:
                completions.append(Completion(s.request_id, s.prompt_token_ids, s.output_token_ids,
                                              self._stops[(request_id, s.choice)].text, s.finish_reason,
                                              s.num_cached_tokens, s.choice))  # fmt: skip
            self._forget(request_id)
        return completions

    def _stop_checker(self, seq: Sequence) -> StopChecker:
        return StopChecker(self.tokenizer, seq.params, self.engine.max_model_len, seq.num_prompt_tokens)

    def _forget(self, request_id: RequestId) -> None:
        for seq in self._choices.pop(request_id, []):
            self._stops.pop((request_id, seq.choice), None)

