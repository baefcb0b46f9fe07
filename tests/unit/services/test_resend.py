"""What a decode worker sends again after a NATS outage lost part of a stream: the tokens
of a running sequence, or of one that finished lately, from the index asked for."""

from libs.engine.model.sequence import Sequence
from libs.protocol.vocabulary import FinishReason
from services.decode import resend
from services.decode.resend import FinishedStreams, resend_chunk


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def seq(request_id: str, generated: list[int], finish: FinishReason | None = None) -> Sequence:
    s = Sequence(request_id, [1, 2, 3] + generated, num_prompt_tokens=3)
    s.finish_reason = finish
    return s


def test_a_running_sequence_is_sent_from_the_index_asked_for():
    running = [seq("a", [10, 11, 12, 13]), seq("b", [20])]
    chunk = resend_chunk("a", 2, running, FinishedStreams(), "decode-0")
    assert (chunk.index, chunk.token_ids, chunk.finish_reason, chunk.instance_id) == (2, [12, 13], None, "decode-0")
    first = resend_chunk("a", 0, running, FinishedStreams(), "decode-0")
    assert (first.token_ids, first.num_prompt_tokens) == ([10, 11, 12, 13], 3)  # from the start: usage's prompt too
    assert resend_chunk("a", 9, running, FinishedStreams(), "decode-0").token_ids == []  # nothing missed


def test_a_finished_stream_is_sent_with_its_finish_and_forgotten_by_count_and_age(monkeypatch):
    monkeypatch.setattr(resend, "KEEP_FINISHED", 2)
    clock = Clock()
    finished = FinishedStreams(clock)
    finished.add(seq("a", [10, 11], FinishReason.STOP))
    chunk = resend_chunk("a", 1, [], finished, "decode-0")
    assert (chunk.index, chunk.token_ids, chunk.finish_reason) == (1, [11], FinishReason.STOP)
    finished.add(seq("b", [20], FinishReason.LENGTH))
    finished.add(seq("c", [30], FinishReason.LENGTH))
    assert resend_chunk("a", 0, [], finished, "decode-0") is None  # the oldest of three, two kept
    clock.now += resend.KEEP_FINISHED_S + 1
    assert resend_chunk("c", 0, [], finished, "decode-0") is None and len(finished) == 0
    assert resend_chunk("zzz", 0, [], finished, "decode-0") is None
