"""Constrained decoding: a request's `Grammar` compiled for this process's tokenizer
(xgrammar), and each sequence's place in it.

A compiled grammar is a function of (grammar, tokenizer) alone, so it is compiled
once per schema and kept in a bounded LRU; a sequence's `GrammarState` is a
matcher over it, built the first time the sequence is sampled and brought up to
date from the tokens it has generated so far. That is how the decode worker (after
the prefill worker's first token) and a migrated request (whose earlier tokens are
the end of its prompt) go on from where the grammar stood, with nothing but the
schema's text on the wire. The sampler asks each state for its row of a token
bitmask and applies the whole batch's mask at once (`logits_processors.py`), or,
where the mask would only narrow the draw, first asks whether the token drawn
without it is allowed (`sampling.py`).
"""

import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from libs.engine.model.tokenizer import Tokenizer
from libs.protocol.errors import InvalidRequestError
from libs.protocol.sampling_params import Grammar

if TYPE_CHECKING:
    import xgrammar

MAX_CACHED_GRAMMARS = 256  # compiled grammars kept per process, least recently used dropped first
# Compact JSON (", " and ": " between items, no free whitespace): a small model left free
# to emit whitespace can fill max_tokens with it before it closes the object.
_SEPARATORS = (", ", ": ")
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[time] file.cc:line: " before its message


def _xgrammar() -> Any:
    # Imported on first use: xgrammar pulls in transformers (seconds), which only a
    # process that meets a grammar should pay for.
    import xgrammar

    return xgrammar


class GrammarCompiler:
    """Compiles grammars for one tokenizer and vocabulary (the model's logits width)
    and keeps the last MAX_CACHED_GRAMMARS; thread-safe (a worker checks a grammar on
    its event loop's executor while its engine thread samples)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_cached: int = MAX_CACHED_GRAMMARS) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_cached = max_cached
        self._compiler: "xgrammar.GrammarCompiler | None" = None
        self._cache: OrderedDict[Grammar, "xgrammar.CompiledGrammar"] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # cache misses, for tests and the benchmark
        # special tokens no grammar accepts (stop tokens aside)
        self._never = frozenset(tokenizer.special_token_ids) - frozenset(tokenizer.eos_token_ids)

    def warm(self) -> None:
        """Import xgrammar and read the vocabulary now (seconds of one core), so the first
        request with a grammar does not wait for it; blocking: a worker runs it in a thread."""
        with self._lock:
            self._compiler = self._compiler or self._build_compiler()

    def compile(self, grammar: Grammar) -> "xgrammar.CompiledGrammar":
        """``grammar`` compiled, from the cache when it is there; InvalidRequestError
        naming the problem when the schema cannot be compiled."""
        with self._lock:
            compiled = self._cache.get(grammar)
            if compiled is not None:
                self._cache.move_to_end(grammar)
                return compiled
            compiler = self._compiler = self._compiler or self._build_compiler()
        compiled = _compile(compiler, grammar)  # outside the lock: a long schema must not stall sampling
        with self._lock:
            self.num_compiled += 1
            self._cache[grammar] = compiled
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        return compiled

    def state(self, grammar: Grammar) -> "GrammarState":
        matcher = _xgrammar().GrammarMatcher(self.compile(grammar))
        return GrammarState(matcher, self._never, self._tokenizer.vocab_size)

    def _build_compiler(self) -> "xgrammar.GrammarCompiler":
        xgr = _xgrammar()
        tok = self._tokenizer
        special = tok.special_token_ids
        # A special token (other than a stop token) is no text a grammar could match: empty bytes say so.
        vocab = [b"" if i in special else tok.token_bytes(i) for i in range(tok.vocab_size)]
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=self.vocab_size,
                                 stop_token_ids=list(tok.eos_token_ids))  # fmt: skip
        return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # the cache is ours, bounded by count


def check_grammar(grammar: Grammar) -> None:
    """InvalidRequestError naming the problem when ``grammar`` cannot be compiled for
    any tokenizer (an unsupported or malformed JSON Schema)."""
    if grammar.kind == "json_schema":
        try:
            _xgrammar().Grammar.from_json_schema(grammar.schema, strict_mode=grammar.strict)
        except (RuntimeError, ValueError, TypeError) as e:
            raise InvalidRequestError(f"Invalid JSON Schema: {_message(e)}") from None


def _compile(compiler: "xgrammar.GrammarCompiler", grammar: Grammar) -> "xgrammar.CompiledGrammar":
    # json_object: any JSON object (what OpenAI's JSON mode promises), written compactly
    schema = grammar.schema if grammar.kind == "json_schema" else '{"type": "object"}'
    try:
        return compiler.compile_json_schema(schema, any_whitespace=False, separators=_SEPARATORS,
                                            strict_mode=grammar.strict)  # fmt: skip
    except (RuntimeError, ValueError, TypeError) as e:
        raise InvalidRequestError(f"Invalid JSON Schema: {_message(e)}") from None


def _message(error: Exception) -> str:
    """xgrammar's error, its first line, without the source location before it."""
    text = str(error).strip()
    return _LOCATION.sub("", text.splitlines()[0]) if text else type(error).__name__


class GrammarState:
    """Where one sequence stands in its grammar: the tokens it has accepted."""

    def __init__(self, matcher: "xgrammar.GrammarMatcher", never: frozenset[int], num_texts: int) -> None:
        self._matcher = matcher
        # Tokens refused before xgrammar sees them: a special token (it warns, once per call)
        # and an id past the tokenizer's, a row of logits padding (its warning reads past its table).
        self._never = never
        self._num_texts = num_texts
        self.num_accepted = 0  # of the sequence's generated tokens

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token ended it."""
        return self._matcher.is_terminated()

    def catch_up(self, generated: list[int]) -> None:
        """Accept the generated tokens this state has not seen (all of them when it is new)."""
        for token_id in generated[self.num_accepted :]:
            self.accept(token_id)

    def accept(self, token_id: int) -> None:
        if not self.try_accept(token_id):
            # only a token the mask allowed is ever kept, so a replay that disagrees is a bug
            raise ValueError(f"token {token_id} does not continue the grammar")

    def try_accept(self, token_id: int) -> bool:
        """Accept ``token_id`` if the grammar allows it next; False (and nothing changed) if not."""
        if token_id in self._never or token_id >= self._num_texts:
            return False
        if not self._matcher.accept_token(token_id):
            return False
        self.num_accepted += 1
        return True

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Row ``row`` of ``bitmask`` ([b, ceil(V / 32)] int32): bit t set iff token t may come next."""
        self._matcher.fill_next_token_bitmask(bitmask, row)


def mask_rows(logits: torch.Tensor, rows: list[int], states: list[GrammarState]) -> None:
    """Set to -inf, in place, every logit of row ``rows[j]`` that ``states[j]`` forbids:
    one bitmask for the batch, unpacked and applied in one masked_fill."""
    b, vocab = len(rows), logits.shape[-1]
    bitmask = torch.zeros(b, -(-vocab // 32), dtype=torch.int32)  # [b, W], on the CPU, where matchers write
    for j, state in enumerate(states):
        state.fill_mask(bitmask, j)
    bits = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> bits) & 1).bool().view(b, -1)[:, :vocab]  # [b, V]
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed.to(logits.device), float("-inf"))

