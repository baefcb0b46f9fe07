"""Token chunks from prefill and decode are put back in generation order."""

from libs.protocol.schema import TokenChunk, TokenLogprobs
from services.gateway.reorder import ChunkReorderer


def chunk(index: int, tokens: list[int], finish: str | None = None) -> TokenChunk:
    return TokenChunk(request_id="r", index=index, token_ids=tokens, finish_reason=finish)


def spans(chunks: list[TokenChunk]) -> list[tuple[int, list[int], str | None]]:
    return [(c.index, c.token_ids, c.finish_reason) for c in chunks]


def test_in_order_chunks_pass_straight_through():
    r = ChunkReorderer()
    assert spans(r.push(chunk(0, [10]))) == [(0, [10], None)]
    assert spans(r.push(chunk(1, [11, 12]))) == [(1, [11, 12], None)]
    assert spans(r.push(chunk(3, [13], "stop"))) == [(3, [13], "stop")]
    assert r.finished and r.next_index == 4


def test_decode_chunks_before_the_prefill_token_wait_for_it():
    r = ChunkReorderer()
    assert r.push(chunk(2, [12])) == []
    assert r.push(chunk(1, [11])) == []
    assert r.num_held == 2
    assert spans(r.push(chunk(0, [10]))) == [(0, [10], None), (1, [11], None), (2, [12], None)]
    assert r.num_held == 0 and r.next_index == 3


def test_a_finish_is_held_until_the_gap_before_it_is_filled():
    r = ChunkReorderer()
    assert spans(r.push(chunk(0, [10]))) == [(0, [10], None)]
    assert r.push(chunk(3, [13], "length")) == []
    assert not r.finished
    assert spans(r.push(chunk(1, [11, 12]))) == [(1, [11, 12], None), (3, [13], "length")]
    assert r.finished


def test_repeated_tokens_are_trimmed_and_duplicates_dropped():
    r = ChunkReorderer()
    r.push(chunk(0, [10, 11, 12]))
    assert r.push(chunk(0, [10])) == []  # already delivered
    assert spans(r.push(chunk(1, [11, 12, 13, 14]))) == [(3, [13, 14], None)]  # overlap trimmed
    assert spans(r.push(chunk(2, [12], "stop"))) == [(5, [], "stop")]  # nothing new but the finish


def test_of_two_chunks_at_one_index_the_longer_one_is_kept():
    r = ChunkReorderer()
    r.push(chunk(2, [12]))
    r.push(chunk(2, [12, 13]))
    r.push(chunk(1, [11]))
    assert spans(r.push(chunk(0, [10]))) == [(0, [10], None), (1, [11], None), (2, [12, 13], None)]


def test_nothing_is_delivered_after_the_finish():
    r = ChunkReorderer()
    r.push(chunk(2, [99]))  # held past the finish: dropped with it
    assert spans(r.push(chunk(0, [10, 11], "stop"))) == [(0, [10, 11], "stop")]
    assert r.num_held == 0
    assert r.push(chunk(2, [12])) == []


def test_a_trimmed_chunk_keeps_the_logprobs_of_the_tokens_it_keeps():
    r = ChunkReorderer()
    r.push(chunk(0, [10, 11]))
    lps = [TokenLogprobs(-0.1 * i, [i], [-0.1 * i]) for i in range(3)]
    (again,) = r.push(TokenChunk(request_id="r", index=0, token_ids=[10, 11, 12], logprobs=lps))  # a retry, further
    assert (again.index, again.token_ids, again.logprobs) == (2, [12], [lps[2]])
