"""The ``logprobs`` of a choice in OpenAI's two shapes: chat's list of content
entries (token, logprob, bytes, top_logprobs) and the completions API's parallel
lists (tokens, token_logprobs, top_logprobs, text_offset).

A token's text is its bytes read as UTF-8 (a token that holds part of a
character shows U+FFFD for it; ``bytes`` has the exact bytes), as vLLM shows it.
A logprob of -inf (a token a control masked) is written -9999.0, as OpenAI and
vLLM write it: JSON has no infinity. Knows nothing of the cluster or HTTP.
"""

from typing import Any

from libs.engine.model.tokenizer import Tokenizer
from libs.protocol.schema import TokenLogprobs

FLOOR = -9999.0


class LogprobsBodies:
    """One request's ``logprobs`` bodies, chunk by chunk (or all at once when it does
    not stream): the completions API's text offsets run on across calls."""

    def __init__(self, tokenizer: Tokenizer, is_chat: bool) -> None:
        self.tokenizer = tokenizer
        self.is_chat = is_chat
        self._text_offset = 0
        self._pieces: dict[int, tuple[str, bytes]] = {}

    def body(self, token_ids: list[int], logprobs: list[TokenLogprobs]) -> dict[str, Any]:
        """The ``logprobs`` of the choice that adds ``token_ids``, one ``logprobs`` entry each."""
        if self.is_chat:
            return {"content": [self._entry(t, lp) for t, lp in zip(token_ids, logprobs)], "refusal": None}
        tokens, offsets = [], []
        for token_id in token_ids:
            text = self._piece(token_id)[0]
            tokens.append(text)
            offsets.append(self._text_offset)
            self._text_offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [_finite(lp.logprob) for lp in logprobs],
            "top_logprobs": [
                {self._piece(t)[0]: _finite(v) for t, v in zip(lp.top_ids, lp.top_logprobs)} for lp in logprobs
            ],
            "text_offset": offsets,
        }

    def _entry(self, token_id: int, lp: TokenLogprobs) -> dict[str, Any]:
        text, raw = self._piece(token_id)
        top = []
        for t, v in zip(lp.top_ids, lp.top_logprobs):
            top_text, top_raw = self._piece(t)
            top.append({"token": top_text, "logprob": _finite(v), "bytes": list(top_raw)})
        return {"token": text, "logprob": _finite(lp.logprob), "bytes": list(raw), "top_logprobs": top}

    def _piece(self, token_id: int) -> tuple[str, bytes]:
        piece = self._pieces.get(token_id)
        if piece is None:
            raw = self.tokenizer.token_bytes(token_id)
            piece = self._pieces[token_id] = (raw.decode("utf-8", errors="replace"), raw)
        return piece


def _finite(logprob: float) -> float:
    return max(logprob, FLOOR)
