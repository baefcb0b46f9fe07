"""Prompt synthesis: token ids for a trace request, such that equal hash ids give
equal token blocks and so the trace's prefix sharing is reproduced exactly.

The trace's 512-token blocks are scaled to ``block_tokens`` tokens each: a request
of ``input_length`` tokens becomes ``round(input_length * block_tokens / 512)``
tokens (at least one). Its full blocks are one deterministic block per hash id
(drawn from ``vocab`` by an RNG seeded with (seed, hash id)); the last, partial
block — never shared, as in the trace — is drawn from an RNG seeded with
(seed, request index). ``max_input`` truncates instead of rescaling: a longer
prompt keeps its first ``max_input // block_tokens`` hash-id blocks and its own
tail fills it to exactly ``max_input`` tokens, so every kept block is still the
block of its hash id and two requests still share exactly the prefix they
shared, capped there. Rescaling per request would break that: the same hash id
would become different tokens in requests of different lengths. Nothing here
knows HTTP.
"""

from collections.abc import Sequence

import numpy as np

from kvserve.replay.trace import TRACE_BLOCK_TOKENS, TraceRequest

_BLOCK_STREAM, _TAIL_STREAM = 0, 1  # keep the two RNG families apart


class PromptSynthesizer:
    def __init__(
        self,
        vocab: Sequence[int],
        block_tokens: int = 16,
        seed: int = 0,
        max_input: int | None = None,
        max_output: int | None = None,
    ) -> None:
        if block_tokens < 1:
            raise ValueError("block_tokens must be at least 1")
        if max_input is not None and max_input < 1 or max_output is not None and max_output < 1:
            raise ValueError("max_input and max_output must be at least 1")
        if len(vocab) < 2:
            raise ValueError("the vocabulary needs at least two token ids")
        self.vocab = np.asarray(vocab, dtype=np.int64)
        self.block_tokens = block_tokens
        self.seed = seed
        self.max_input = max_input
        self.max_output = max_output
        self._blocks: dict[int, list[int]] = {}

    def input_length(self, request: TraceRequest) -> int:
        """The number of prompt tokens ``prompt(request)`` returns."""
        scaled = max(1, (request.input_length * self.block_tokens + TRACE_BLOCK_TOKENS // 2) // TRACE_BLOCK_TOKENS)
        return scaled if self.max_input is None else min(scaled, self.max_input)

    def output_length(self, request: TraceRequest) -> int:
        """``max_tokens`` for the request: its output length, capped by ``max_output``, at least 1."""
        length = max(1, request.output_length)
        return length if self.max_output is None else min(length, self.max_output)

    def num_shared_blocks(self, request: TraceRequest) -> int:
        """How many of the prompt's blocks are hash-id blocks (the rest is the request's own tail)."""
        return min(self.input_length(request) // self.block_tokens, len(request.hash_ids))

    def block(self, hash_id: int) -> list[int]:
        """The ``block_tokens`` token ids that stand for ``hash_id``."""
        block = self._blocks.get(hash_id)
        if block is None:
            rng = np.random.default_rng([self.seed, _BLOCK_STREAM, hash_id])
            block = self.vocab[rng.integers(0, len(self.vocab), self.block_tokens)].tolist()
            self._blocks[hash_id] = block
        return block

    def prompt(self, request: TraceRequest) -> list[int]:
        length = self.input_length(request)
        num_blocks = self.num_shared_blocks(request)
        tokens: list[int] = []
        for hash_id in request.hash_ids[:num_blocks]:
            tokens += self.block(hash_id)
        rng = np.random.default_rng([self.seed, _TAIL_STREAM, request.index])
        tokens += self.vocab[rng.integers(0, len(self.vocab), length - len(tokens))].tolist()
        return tokens


def ordinary_vocab(tokenizer_json: str) -> list[int]:
    """Every token id of a Hugging Face ``tokenizer.json`` that is not a special
    (added, control) token: what a synthetic prompt may contain."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    special = {i for i, added in tok.get_added_tokens_decoder().items() if added.special}
    return [i for i in range(tok.get_vocab_size(with_added_tokens=True)) if i not in special]
