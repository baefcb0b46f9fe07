"""The receiver's ticket rules, without sockets: a greeting proves the token and is
good once, every byte is written at most once, and a ticket serves one transport."""

import pytest

from libs.transfer.ranges import RangeSet, WrittenRanges
from libs.transfer.segment import SHM_DIR, new_segment_name
from libs.transfer.tickets import OpenTicket, Refusal, TicketBook, claim, claim_path, greeting_proof, ticket_id


@pytest.fixture
def segment_name():
    name = new_segment_name("test", "tickets")
    yield name
    for path in SHM_DIR.glob(f"{name}.claim-*"):
        path.unlink()


def open_ticket(segment: str, ranges=((0, 100),), tcp: bool = True, token: str = "a" * 32) -> OpenTicket:
    return OpenTicket(token, segment, memoryview(bytearray(1000)), RangeSet(list(ranges)), float("inf"), tcp=tcp)


def test_written_ranges_merge_and_refuse_any_overlap():
    written = WrittenRanges()
    assert written.add(10, 10) and written.add(30, 10) and written.add(20, 10)  # [10, 40) in one piece
    assert (written._starts, written._ends, written.total) == ([10], [40], 30)
    for offset, length in [(10, 1), (39, 5), (5, 6), (0, 100), (25, 2)]:
        assert not written.add(offset, length), (offset, length)
    assert written.add(40, 5) and written.add(0, 10) and written.add(50, 0)
    assert (written._starts, written._ends, written.total) == ([0], [45], 45)


def test_a_greeting_needs_the_token_and_is_good_once(segment_name):
    ticket = open_ticket(segment_name)
    assert ticket.admit(1, greeting_proof("b" * 32, 1)) == Refusal.FORGED  # the id alone proves nothing
    assert ticket.nonces == set()  # and spends nothing
    assert ticket.admit(1, greeting_proof(ticket.token, 1)) is None
    assert ticket.admit(1, greeting_proof(ticket.token, 1)) == Refusal.REPLAYED
    assert ticket.admit(2, greeting_proof(ticket.token, 2)) is None  # another connection of the same transfer


def test_each_byte_is_written_once_and_a_spent_ticket_takes_no_greeting(segment_name):
    ticket = open_ticket(segment_name, ranges=[(0, 100)])
    assert ticket.reserve(0, 60) is None
    assert ticket.reserve(50, 10) == Refusal.REWRITE
    assert ticket.reserve(90, 20) == Refusal.OUTSIDE
    assert ticket.reserve(60, 40) is None
    assert ticket.admit(5, greeting_proof(ticket.token, 5)) == Refusal.SPENT


def test_a_ticket_is_claimed_by_one_transport(segment_name):
    local = open_ticket(segment_name, tcp=False)
    assert local.admit(1, greeting_proof(local.token, 1)) == Refusal.NOT_TCP

    by_shm = open_ticket(segment_name, token="c" * 32)
    assert claim(segment_name, by_shm.id)  # a shared-memory writer took it first
    assert by_shm.admit(1, greeting_proof(by_shm.token, 1)) == Refusal.CLAIMED

    by_tcp = open_ticket(segment_name, token="d" * 32)
    assert by_tcp.admit(1, greeting_proof(by_tcp.token, 1)) is None
    assert not claim(segment_name, by_tcp.id)  # now no shared-memory writer can


def test_closing_or_expiring_a_ticket_removes_its_claim(segment_name):
    now = [0.0]
    book = TicketBook(clock=lambda: now[0])
    closed = open_ticket(segment_name, token="e" * 32)
    expiring = OpenTicket("f" * 32, segment_name, memoryview(bytearray(10)), RangeSet([(0, 10)]), expires_at=5.0)
    book.open(closed)
    book.open(expiring)
    assert claim(segment_name, closed.id) and claim(segment_name, expiring.id)
    assert book.close(closed.token) is closed
    assert not claim_path(segment_name, closed.id).exists()
    now[0] = 6.0
    book.open(open_ticket(segment_name, token="g" * 32))  # issuing sweeps the expired
    assert book.get(ticket_id(expiring.token)) is None and len(book) == 1
    assert not claim_path(segment_name, expiring.id).exists()
