"""What a request may carry: the range of every number, the fields each endpoint
reads, ignores or refuses, how large its body may be and in which encodings, and
how deep its JSON may nest.

`openai_protocol` enforces these while parsing; `openapi` publishes them, so the
parser and the description cannot drift apart.
"""

import zlib
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from libs.protocol.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_N  # noqa: F401 (re-exported)
from services.gateway.errors import BodyTooLargeError, InvalidParameterError, UnsupportedEncodingError

MAX_BODY_BYTES = 1024**2  # a request body, after its Content-Encoding is undone
CONTENT_CODINGS = ("gzip", "deflate", "identity")  # what a request body may be sent in
MAX_JSON_DEPTH = 32  # nesting levels of arrays and objects a request body may have
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # what torch's generators and msgpack carry
MAX_SCHEMA_BYTES = 64 * 1024  # a response_format or tool JSON Schema, as compact JSON (it rides every hop)
MAX_TOOLS = 128  # OpenAI's bound
TOOL_CHOICES = ("none", "auto", "required")  # or {"type": "function", "function": {"name": ...}}


@dataclass(frozen=True)
class Range:
    """The values a numeric field may take: [minimum, maximum], or (minimum, maximum];
    no maximum: any number above the minimum (JSON has no infinity)."""

    minimum: int | float
    maximum: int | float | None
    exclusive_minimum: bool = False

    def __contains__(self, value: int | float) -> bool:
        above = value > self.minimum if self.exclusive_minimum else value >= self.minimum
        return above and (self.maximum is None or value <= self.maximum)  # exact for any int: no float conversion

    def __str__(self) -> str:
        if self.maximum is None:
            return f"{'(' if self.exclusive_minimum else '['}{self.minimum}, ∞)"
        return f"{'(' if self.exclusive_minimum else '['}{self.minimum}, {self.maximum}]"


# Every number a request may carry; for arrays, every item.
RANGES: dict[str, Range] = {
    "max_tokens": Range(1, INT32_MAX),
    "max_completion_tokens": Range(1, INT32_MAX),
    "n": Range(1, MAX_N),
    "temperature": Range(0.0, 100.0),
    "top_p": Range(0.0, 1.0, exclusive_minimum=True),
    "top_k": Range(-1, INT32_MAX),  # vLLM: -1 and 0 mean "no top-k cut"
    "seed": Range(INT64_MIN, INT64_MAX),
    "stop_token_ids": Range(0, INT32_MAX),
    "prompt": Range(0, INT32_MAX),  # token ids
    "presence_penalty": Range(-2.0, 2.0),
    "frequency_penalty": Range(-2.0, 2.0),
    "repetition_penalty": Range(0.0, None, exclusive_minimum=True),  # vLLM: any number above 0
    "min_p": Range(0.0, 1.0),
    "min_tokens": Range(0, INT32_MAX),  # and at most max_tokens
    "logit_bias": Range(-100.0, 100.0),  # each bias; the keys are token ids of the model's vocabulary
    "top_logprobs": Range(0, MAX_LOGPROBS),  # chat
    "logprobs": Range(0, MAX_LOGPROBS),  # completions (OpenAI's maximum is 5, vLLM's 20)
}

# The fields each endpoint reads. Any other field is refused, as OpenAI refuses an
# unrecognized argument, so a client never gets an answer that ignored what it asked.
SHARED_FIELDS = frozenset({
    "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
    "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "logprobs", "n",
    "stream", "stream_options", "cache_salt", "response_format",
})  # fmt: skip
CHAT_FIELDS = SHARED_FIELDS | {
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls"
}  # fmt: skip
COMPLETION_FIELDS = SHARED_FIELDS | {"prompt"}
# Accepted (type-checked) and ignored: they ask nothing of the answer itself.
IGNORED_FIELDS: dict[str, type] = {
    "user": str, "safety_identifier": str, "prompt_cache_key": str, "metadata": dict, "service_tier": str,
}  # fmt: skip
# Features kvserve does not implement: accepted only as null or the value that turns them off.
UNSUPPORTED_UNLESS: dict[str, tuple[Any, ...]] = {
    "functions": ([],),
    "function_call": ("none",),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "reasoning_effort": (),
    "verbosity": (),
    "web_search_options": (),
    "store": (False,),
    "echo": (False,),
    "best_of": (1,),
    "suffix": ("",),
}
STREAM_OPTIONS = ("include_usage", "include_obfuscation")  # the second is accepted and ignored


def content_codings(content_encoding: str | None) -> list[str]:
    """The codings a Content-Encoding header lists, in the order they were applied;
    UnsupportedEncodingError (415) for one the gateway does not decode."""
    codings = [c.strip().lower() for c in (content_encoding or "").split(",") if c.strip()]
    for coding in codings:
        if coding not in CONTENT_CODINGS:
            raise UnsupportedEncodingError(
                f"Content-Encoding {coding!r} is not supported; send the body as is, gzip or deflate."
            )
    return codings


def decode_content(data: bytes, codings: list[str]) -> bytes:
    """The body ``data`` with ``codings`` undone, last applied first. Inflating stops
    one byte past MAX_BODY_BYTES, so a small body that would inflate to gigabytes
    costs a mebibyte: BodyTooLargeError (413). Data that is not what its coding
    says is an InvalidParameterError (400)."""
    for coding in reversed(codings):
        if coding != "identity":
            data = _inflate(data, coding)
    return data


def _inflate(data: bytes, coding: str) -> bytes:
    out = bytearray()
    rest = data
    while True:  # gzip allows several members one after another
        # zlib's header says deflate (RFC 1950); some clients send bare deflate (RFC 1951), as browsers accept
        bare = coding == "deflate" and (not rest or rest[0] & 0x0F != 8)
        wbits = 16 + zlib.MAX_WBITS if coding == "gzip" else -zlib.MAX_WBITS if bare else zlib.MAX_WBITS
        inflater = zlib.decompressobj(wbits)
        try:
            out += inflater.decompress(rest, MAX_BODY_BYTES + 1 - len(out))
        except zlib.error as e:
            raise InvalidParameterError(f"The request body is not valid {coding} data ({e}).") from None
        if len(out) > MAX_BODY_BYTES:
            raise BodyTooLargeError(f"The request body is larger than {MAX_BODY_BYTES} bytes once decoded.")
        if not inflater.eof:
            raise InvalidParameterError(f"The request body is not valid {coding} data (it ends too early).")
        rest = inflater.unused_data
        if not rest or coding != "gzip":
            break
    if rest:
        raise InvalidParameterError(f"The request body is not valid {coding} data (bytes follow its end).")
    return bytes(out)


def decode_body(data: bytes) -> Any:
    """The JSON value of a request body, refused before decoding when it nests too deep."""
    might_nest_too_deep = data.count(b"[") + data.count(b"{") > MAX_JSON_DEPTH
    if might_nest_too_deep and json_depth(data) > MAX_JSON_DEPTH:
        raise InvalidParameterError(f"The JSON body of your request nests deeper than {MAX_JSON_DEPTH} levels.")
    try:
        return msgspec.json.decode(data)
    except msgspec.DecodeError as e:
        raise InvalidParameterError(f"We could not parse the JSON body of your request: {e}") from None


_NESTING = np.zeros(256, np.int8)
_NESTING[[ord("["), ord("{")]] = 1
_NESTING[[ord("]"), ord("}")]] = -1


def json_depth(data: bytes) -> int:
    """How deep the arrays and objects of the JSON text ``data`` nest, brackets inside
    strings not counted; vectorized, so a megabyte of brackets costs milliseconds."""
    b = np.frombuffer(data, np.uint8)
    idx = np.arange(b.size, dtype=np.int64)
    last_plain = np.maximum.accumulate(np.where(b != ord("\\"), idx, -1))  # the last byte that is no backslash
    backslashes_before = np.zeros(b.size, np.int64)
    backslashes_before[1:] = idx[:-1] - last_plain[:-1]
    delimiters = (b == ord('"')) & (backslashes_before % 2 == 0)  # a quote no backslash escapes
    in_string = np.cumsum(delimiters) % 2 == 1
    steps = np.where(in_string, 0, _NESTING[b].astype(np.int64))
    return int(np.cumsum(steps).max(initial=0))
