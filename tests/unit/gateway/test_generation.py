"""In-order tokens become text: stop strings end it here (and cancel the workers),
a worker's finish flushes what was held back, usage counts what was generated."""

from dataclasses import replace

from libs.protocol.sampling_params import SamplingParams
from libs.protocol.schema import TokenChunk, TokenLogprobs
from services.gateway.text_stream import Delta, TextStream, stream_deltas

EOS = 257  # the tiny checkpoint's </s>


def ids(text: str) -> list[int]:
    return list(text.encode())  # the byte tokenizer: id = byte


def chunk(index: int, text: str, finish: str | None = None, extra: list[int] = (), cached: int = 0) -> TokenChunk:
    return TokenChunk(request_id="r", index=index, token_ids=ids(text) + list(extra), finish_reason=finish,
                      num_cached_tokens=cached)  # fmt: skip


def shown(delta: Delta) -> Delta:
    """What a delta shows, without the tokens it accounts for."""
    return replace(delta, token_ids=[], logprobs=None)


def stream(served_model, **sampling) -> TextStream:
    params = SamplingParams(**{"max_tokens": 100, **sampling})
    return TextStream(served_model.tokenizer, params, served_model.max_model_len, num_prompt_tokens=10)


def test_text_flows_and_the_worker_finish_ends_it(served_model):
    t = stream(served_model)
    assert shown(t.feed(chunk(0, "He", cached=8))) == Delta("He")
    assert shown(t.feed(chunk(2, "llo", finish="length"))) == Delta("llo", "length")
    assert (t.num_completion_tokens, t.num_cached_tokens, t.finish_reason) == (5, 8, "length")


def test_eos_is_counted_but_not_shown(served_model):
    t = stream(served_model)
    assert shown(t.feed(chunk(0, "Hi", finish="stop", extra=[EOS]))) == Delta("Hi", "stop")
    assert t.num_completion_tokens == 3


def test_a_stop_string_ends_the_text_before_the_workers_do(served_model):
    t = stream(served_model, stop=["wor"])
    assert shown(t.feed(chunk(0, "Hello w"))) == Delta("Hello")  # len("wor") - 1 characters held back
    assert shown(t.feed(chunk(7, "orld"))) == Delta(" ", "stop", stopped_early=True)
    assert t.text == "Hello " and t.num_completion_tokens == 9  # counted up to the token that completed "wor"


def test_a_worker_finish_releases_text_held_back_for_a_stop_string(served_model):
    t = stream(served_model, stop=["xyz"])
    assert shown(t.feed(chunk(0, "abcx"))) == Delta("ab")
    assert shown(t.feed(chunk(4, "y", finish="length"))) == Delta("cxy", "length")


def test_the_max_tokens_limit_is_enforced_here_too(served_model):
    t = stream(served_model, max_tokens=3)
    assert shown(t.feed(chunk(0, "abcdef"))) == Delta("abc", "length", stopped_early=True)


def test_max_tokens_one_shows_the_token_even_when_it_is_half_a_character(served_model):
    t = stream(served_model, max_tokens=1)
    assert shown(t.feed(chunk(0, "", extra=["é".encode()[0]]))) == Delta("\ufffd", "length", stopped_early=True)
    assert t.num_completion_tokens == 1 and t.text == "\ufffd"  # what decoding the token shows


def test_a_finish_completes_a_character_split_across_tokens_when_it_can(served_model):
    t = stream(served_model)
    assert shown(t.feed(chunk(0, "a", extra=["€".encode()[0]]))) == Delta("a")  # half of "€" is held back
    assert shown(t.feed(chunk(2, "", extra=list("€".encode()[1:]), finish="length"))) == Delta("€", "length")


def test_a_failure_releases_the_text_held_back_for_a_stop_string(served_model):
    t = stream(served_model, stop=["xyz"])
    assert shown(t.feed(chunk(0, "abcx"))) == Delta("ab")
    assert shown(t.fail()) == Delta("cx", "error")
    assert (t.text, t.finish_reason, t.num_completion_tokens) == ("abcx", "error", 4)


class FakeSource:
    def __init__(self, batches: list[list[TokenChunk]]) -> None:
        self.batches = batches
        self.cancels: list[str] = []

    async def next_chunks(self) -> list[TokenChunk]:
        return self.batches.pop(0)

    async def cancel(self, reason: str) -> None:
        self.cancels.append(reason)


async def test_stream_deltas_cancels_the_workers_on_a_stop_string(served_model):
    source = FakeSource([[], [chunk(0, "Hel")], [chunk(3, "lo."), chunk(6, "never read")]])
    deltas = [d async for d in stream_deltas(source, [stream(served_model, stop=["."])])]
    assert [shown(d) for d in deltas] == [Delta("Hel"), Delta("lo", "stop", stopped_early=True)]
    assert source.cancels == ["stop"]


async def test_stream_deltas_sends_no_cancel_when_the_workers_finished(served_model):
    source = FakeSource([[chunk(0, "ok", finish="stop", extra=[EOS])]])
    deltas = [d async for d in stream_deltas(source, [stream(served_model)])]
    assert [shown(d) for d in deltas] == [Delta("ok", "stop")]
    assert source.cancels == []


def test_each_delta_carries_the_tokens_it_counts_and_their_logprobs(served_model):
    t = stream(served_model, stop=["wor"])
    lps = [TokenLogprobs(-float(i)) for i in range(7)]
    held = t.feed(TokenChunk(request_id="r", index=0, token_ids=ids("Hello w"), logprobs=lps))
    # " w" is held back (a stop string may start there), its tokens and logprobs are not
    assert (held.text, held.token_ids, held.logprobs) == ("Hello", ids("Hello w"), lps)
    # the stop string ends the text at the third token: the fourth is neither counted nor given logprobs
    lps = [TokenLogprobs(-1.0), TokenLogprobs(-2.0), TokenLogprobs(-3.0), TokenLogprobs(-4.0)]
    last = t.feed(TokenChunk(request_id="r", index=7, token_ids=ids("orld"), logprobs=lps))
    assert (last.text, last.finish_reason, last.token_ids, last.logprobs) == (" ", "stop", ids("or"), lps[:2])
    assert t.num_completion_tokens == 9
