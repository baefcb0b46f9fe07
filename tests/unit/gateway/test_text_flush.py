"""Whatever ends a request, the text it released is exactly the text of the tokens
usage counts: a property over random token streams (UTF-8 split across tokens,
invalid bytes, special tokens), chunkings, stop strings and stop tokens, checked
against a plain reference that decodes whole token lists."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libs.protocol.sampling_params import SamplingParams
from libs.protocol.schema import TokenChunk
from services.gateway.text_stream import Delta, TextStream

BOS, EOS = 256, 257  # the tiny checkpoint's <s> and </s> (special: never shown)
PROMPT_TOKENS = 10
# Bytes of characters of every UTF-8 length, so tokens often split one, and a few more.
PIECES = sorted(set("ab \n".encode() + "é€😀".encode() + bytes([0x80, 0xFF])))
ALPHABET = "ab \né€😀\ufffd"


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids)


def shown_so_far(tokenizer, ids: list[int]) -> str:
    """What an incremental decoder has let out after ``ids``: the longest decoded
    prefix of them that does not end in an unfinished character."""
    for j in range(len(ids), 0, -1):
        text = tokenizer.decode(ids[:j])
        if not text.endswith("\ufffd"):
            return text
    return ""


def first_stop(text: str, stops: list[str]) -> int | None:
    for stop in stops:
        if (at := text.find(stop)) != -1:
            return at
    return None


def reference(tokenizer, tokens, params: SamplingParams, room: int, worker_finish: str) -> tuple[str, int, str]:
    """(text, completion tokens, finish reason) from whole decodes, token by token."""
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else {EOS})
    text_ids, n = [], 0
    for token in tokens:
        n += 1
        if token in stop_ids:
            return end(tokenizer, text_ids, params, "stop"), n, "stop"
        text_ids.append(token)
        shown = shown_so_far(tokenizer, text_ids)
        if (at := first_stop(shown, params.stop)) is not None:
            return shown[:at], n, "stop"
        if n >= params.max_tokens or n >= room:
            return end(tokenizer, text_ids, params, "length"), n, finish_after(tokenizer, text_ids, params, "length")
    return end(tokenizer, text_ids, params, worker_finish), n, finish_after(tokenizer, text_ids, params, worker_finish)


def end(tokenizer, text_ids, params, reason) -> str:
    whole = decode(tokenizer, text_ids)
    at = first_stop(whole, params.stop)
    return whole if at is None else whole[:at]


def finish_after(tokenizer, text_ids, params, reason) -> str:
    """A stop string the final decode completes makes it a stop (never an error)."""
    completed = first_stop(decode(tokenizer, text_ids), params.stop) is not None
    return "stop" if completed and reason != "error" else reason


def worker_stream(tokens: list[int], params: SamplingParams, room: int) -> tuple[list[int], str]:
    """What the workers send: tokens up to a stop token, max_tokens or the window, and why they stopped."""
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else {EOS})
    for i, token in enumerate(tokens):
        if token in stop_ids:
            return tokens[: i + 1], "stop"
        if i + 1 >= params.max_tokens or i + 1 >= room:
            return tokens[: i + 1], "length"
    return tokens, "length"


@st.composite
def cases(draw):
    tokens = draw(st.lists(st.sampled_from([*PIECES, BOS, EOS]) | st.integers(0, 255), min_size=1, max_size=24))
    params = SamplingParams(
        max_tokens=draw(st.integers(1, 30)),
        stop=draw(st.lists(st.text(ALPHABET, min_size=1, max_size=3), max_size=2)),
        stop_token_ids=draw(st.lists(st.sampled_from(PIECES), max_size=1)),
        ignore_eos=draw(st.booleans()),
    )
    room = draw(st.integers(1, 40))
    sent, worker_finish = worker_stream(tokens, params, room)
    failed_after = draw(st.none() | st.integers(0, len(sent) - 1))  # the request fails after this many tokens
    if failed_after is not None:
        sent, worker_finish = sent[:failed_after], "error"
    cuts = sorted(draw(st.sets(st.integers(1, max(len(sent) - 1, 1)), max_size=len(sent))))
    return sent, worker_finish, params, room, cuts


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases())
def test_the_deltas_are_the_decoded_completion_up_to_its_stop_string(served_model, case):
    sent, worker_finish, params, room, cuts = case
    tokenizer = served_model.tokenizer
    text = TextStream(tokenizer, params, PROMPT_TOKENS + room, PROMPT_TOKENS)
    chunks, start = [], 0
    for stop in [*[c for c in cuts if c < len(sent)], len(sent)]:
        if stop > start or (stop == start == 0 and not sent):
            chunks.append(TokenChunk(request_id="r", index=start, token_ids=sent[start:stop]))
            start = stop
    if worker_finish != "error" and chunks:
        chunks[-1].finish_reason = worker_finish
    deltas: list[Delta] = []
    for chunk in chunks:
        deltas.append(text.feed(chunk))
        if deltas[-1].finish_reason is not None:
            break
    if text.finish_reason is None:
        assert worker_finish == "error"
        deltas.append(text.fail())
    expected_text, expected_tokens, expected_finish = reference(tokenizer, sent, params, room, worker_finish)
    assert "".join(d.text for d in deltas) == expected_text == text.text
    assert text.num_completion_tokens == expected_tokens
    assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + [expected_finish]
