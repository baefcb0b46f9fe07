"""What a request asks of sampling and stopping; a wire type, so it imports no torch."""

import math
from typing import Literal

import msgspec

from libs.protocol.errors import InvalidRequestError

MAX_N = 128  # sequences per request (OpenAI's bound)
MAX_LOGPROBS = 20  # top alternatives per token (vLLM's default max_logprobs)
MAX_LOGIT_BIAS = 300  # entries in logit_bias
LOGIT_BIAS_LIMIT = 100.0  # |bias| (OpenAI's bounds)


class Grammar(msgspec.Struct, frozen=True, kw_only=True):
    """What a request's output must match, as the request gave it: a JSON object, or
    JSON valid under a JSON Schema. It travels as text, never as compiled state, so
    every worker (and a migrated request's next one) compiles it for its own
    tokenizer and replays the tokens generated so far (`model/grammar.py`)."""

    kind: Literal["json_object", "json_schema"]
    schema: str = ""  # the JSON Schema, as JSON text (json_schema only)
    strict: bool = False  # OpenAI's strict: no property the schema does not name


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    n: int = 1  # sequences to generate from the prompt (one prefill, its KV blocks shared)
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int | None = None  # None: no top-k cut
    min_p: float = 0.0  # drop tokens less likely than min_p times the likeliest (after temperature)
    seed: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0  # end-of-sequence and stop tokens are masked until this many are generated
    # vLLM's penalties: presence and frequency over the generated tokens, repetition over prompt and generated
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = msgspec.field(default_factory=dict)  # token id -> added to its logit
    logprobs: int | None = None  # None: none; n: the sampled token's logprob and the n likeliest
    grammar: Grammar | None = None  # constrained decoding: only tokens the grammar allows are drawn

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def changes_logits(self) -> bool:
        """Whether the sampler has more to do than temperature, top-k and top-p: a batch
        where no request does takes the plain path."""
        return bool(self.has_penalties or self.logit_bias or self.min_tokens or self.min_p or self.logprobs is not None
                    or self.grammar is not None)

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidRequestError naming the first parameter out of range (with
        ``vocab_size``, a logit_bias token id outside the vocabulary too)."""
        if not 1 <= self.n <= MAX_N:
            raise InvalidRequestError(f"n must be in [1, {MAX_N}], got {self.n}")
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequestError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise InvalidRequestError(f"top_k must be at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty < math.inf:
            raise InvalidRequestError(f"repetition_penalty must be greater than 0, got {self.repetition_penalty}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(
                f"logit_bias may have at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}"
            )
        for token_id, bias in self.logit_bias.items():
            if vocab_size is not None and not 0 <= token_id < vocab_size:
                raise InvalidRequestError(f"logit_bias token id {token_id} is outside the vocabulary [0, {vocab_size})")
            if token_id < 0 or not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise InvalidRequestError(
                    f"logit_bias must map token ids to values in [-100, 100], got {token_id}: {bias}"
                )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must not be empty")
        if self.grammar is not None and self.grammar.kind == "json_schema" and not self.grammar.schema:
            raise InvalidRequestError("grammar of kind json_schema must carry its schema")
