"""Turns a sequence's generated tokens into text, and decides when it stops.

Stops on an end-of-sequence or stop token (not shown), on a stop string (the
text is cut before it; none is looked for in the text of a request's first
min_tokens tokens, as in vLLM), on max_tokens, or when the context window is full.
While stop strings are set, the last ``len(longest stop) - 1`` characters are
held back, so a client never sees the start of a stop string that later
completes. At the end, the start of a UTF-8 character that no token completed is
shown as a whole decode of the tokens shows it (U+FFFD), not dropped.
"""

from collections.abc import Collection

from libs.engine.model.sequence import Sequence
from libs.engine.model.tokenizer import Tokenizer
from libs.protocol.sampling_params import SamplingParams
from libs.protocol.vocabulary import FinishReason


def check_finish(seq: Sequence, eos_token_ids: Collection[int], max_model_len: int) -> FinishReason | None:
    """Whether the token just appended ends ``seq``, without looking at text.

    Workers use this; stop strings need the text and are the gateway's job
    (`StopChecker` below, which applies the same token rules first).
    """
    return token_finish(seq.token_ids[-1], seq.num_output_tokens, seq.num_tokens, seq.params, eos_token_ids,
                        max_model_len)  # fmt: skip


def token_finish(token_id: int, num_output_tokens: int, num_tokens: int, params: SamplingParams,
                 eos_token_ids: Collection[int], max_model_len: int) -> FinishReason | None:  # fmt: skip
    """The token rules, for a sequence whose last token is ``token_id``: its
    ``num_output_tokens``-th generated, its ``num_tokens``-th in all (prompt included).
    STOP: a stop token, or an end-of-sequence token unless ignore_eos; LENGTH:
    max_tokens reached or the context window full."""
    if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in eos_token_ids):
        return FinishReason.STOP
    if num_output_tokens >= params.max_tokens or num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None


class StopChecker:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, max_model_len: int, num_prompt_tokens: int) -> None:
        self.params = params
        self._tokenizer = tokenizer
        self._stream = tokenizer.decode_stream()
        self._text_ids: list[int] = []  # the tokens that make text (stop tokens do not)
        self._cut = False  # a stop string cut the text
        self._eos_token_ids = tokenizer.eos_token_ids
        self._holdback = max((len(s) for s in params.stop), default=1) - 1
        self._max_model_len = max_model_len
        self._num_prompt_tokens = num_prompt_tokens
        self.text = ""
        self.num_tokens = 0
        self._emitted = 0
        self.finish_reason: FinishReason | None = None

    def add(self, token_id: int) -> str:
        """Account for one generated token; return the text that is now safe to show."""
        assert self.finish_reason is None, "token added after the sequence finished"
        self.num_tokens += 1
        by_token = token_finish(token_id, self.num_tokens, self._num_prompt_tokens + self.num_tokens, self.params,
                                self._eos_token_ids, self._max_model_len)  # fmt: skip
        if by_token == FinishReason.STOP:  # a stop token: it makes no text
            self.finish_reason = FinishReason.STOP
        else:
            self._text_ids.append(token_id)
            before = len(self.text)
            self.text += self._stream.step(token_id)
            self._check_stop_strings(before)  # a stop string ends it first
        if self.finish_reason is None:
            self.finish_reason = by_token
        if self.finish_reason is not None and not self._cut:  # the start of a character no token completes
            before = len(self.text)
            self.text += self.undecoded_tail()
            self._check_stop_strings(before)
        end = len(self.text) if self.finish_reason else max(self._emitted, len(self.text) - self._holdback)
        delta, self._emitted = self.text[self._emitted : end], end
        return delta

    @property
    def cut_by_stop_string(self) -> bool:
        """A stop string ended the text (which is cut before it)."""
        return self._cut

    def undecoded_tail(self) -> str:
        """The text of the tokens the incremental decoder still holds (the start of a
        UTF-8 character no later token completed), as decoding every token shows it
        (U+FFFD); "" once a stop string cut the text."""
        if self._cut:
            return ""
        whole = self._tokenizer.decode(self._text_ids)
        return whole[len(self.text) :] if whole.startswith(self.text) else ""

    def flush(self) -> str:
        """The text held back for a possible stop string, once the sequence ended
        for another reason (e.g. a worker stopped it); nothing is held back after."""
        delta, self._emitted = self.text[self._emitted :], len(self.text)
        return delta

    def _check_stop_strings(self, before: int) -> None:
        if self.num_tokens < self.params.min_tokens:  # vLLM's min_tokens: no stop string ends it before
            return
        for stop in self.params.stop:
            at = self.text.find(stop, max(0, before - len(stop) + 1))
            if at != -1:
                self.text = self.text[:at]
                self.finish_reason = FinishReason.STOP
                self._cut = True
                return
