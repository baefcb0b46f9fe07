"""Active-active conductor replicas: two schedulers that take alternate admissions and
book each other's (through the wire message) route exactly as one conductor would;
a peer's booking is settled by progress like an own one, never replaces an own one,
and is replaced by an own re-admission of the same request."""

from libs.protocol import schema
from libs.protocol.schema import ConductorAdmission
from libs.protocol.vocabulary import Role
from services.conductor.admission_policy import build_policy
from services.conductor.admitter import Admitter
from services.conductor.replicas import Replicas
from services.conductor.settings import DEFAULT_POLICY
from tests.unit.conductor.helpers import Clock, beat, block, cluster, config, request

BEATS = [beat("p0", Role.PREFILL), beat("p1", Role.PREFILL), beat("p2", Role.PREFILL),
         beat("d0", Role.DECODE), beat("d1", Role.DECODE)]  # fmt: skip


def replica(conductor_id: str, clock: Clock | None = None) -> Replicas:
    view, index, _ = cluster(*BEATS)
    if clock is not None:
        view.clock = clock
    return Replicas(conductor_id, Admitter(build_policy(DEFAULT_POLICY), view, index, config()))


def requests(n: int):
    """Distinct prompts (no shared prefix), so the choice is the load's alone."""
    return [request(f"r{i}", tokens=170 + 16 * i, blocks=[block(100 + i)] * 10, max_tokens=64) for i in range(n)]


def drive(replicas: list[Replicas], share: bool, n: int = 16) -> list[tuple[str, str]]:
    """The replicas take turns admitting ``n`` requests, each booking the others' when
    ``share``; every replica hears each request's first token three admissions later and
    its end six later. The chosen (prefill, decode) of each request."""
    clock, chosen, reqs = replicas[0].scheduler.view.clock, [], requests(n)
    for i, r in enumerate(reqs):
        me = replicas[i % len(replicas)]
        d = me.scheduler.admit(r)
        assert d.admitted
        chosen.append((d.prefill_id, d.decode_id))
        wire = schema.decode(schema.encode(me.shared(r.request_id)), ConductorAdmission)
        assert not me.on_peer_admission(wire)  # its own, echoed back
        for peer in replicas:
            if share and peer is not me:
                assert peer.on_peer_admission(wire)
        clock.now += 0.05
        for replica in replicas:  # the gateway's progress reports reach every replica
            if i >= 3:
                replica.scheduler.first_token(reqs[i - 3].request_id, ttft_s=0.2)
            if i >= 6:
                replica.scheduler.finished(reqs[i - 6].request_id, num_output_tokens=20)
    return chosen


def test_two_replicas_taking_alternate_admissions_route_as_one_conductor():
    clock = Clock()
    single = drive([replica("conductor-a", clock)], share=False)
    assert len({p for p, _ in single}) == 3 and len({d for _, d in single}) == 2  # spread over every worker

    clock = Clock()
    pair = [replica("conductor-a", clock), replica("conductor-b", clock)]
    assert drive(pair, share=True) == single
    assert [r.scheduler.num_own for r in pair] == [3, 3] and len(pair[0].scheduler.admitted) == 6

    clock = Clock()
    blind = drive([replica("conductor-a", clock), replica("conductor-b", clock)], share=False)
    assert blind != single  # blind to each other, they pile on the same workers


def test_a_peer_booking_is_settled_by_progress_and_counted_as_the_peers():
    a, b = replica("conductor-a"), replica("conductor-b")
    a.scheduler.admit(request("r1", max_tokens=64))
    b.on_peer_admission(a.shared("r1"))
    record = b.scheduler.admitted["r1"]
    prefill = b.scheduler.view.get(record.prefill_id)
    decode = b.scheduler.view.get(record.decode_id)
    assert (record.origin, prefill.prefill.num_pending, decode.decode.num_records) == ("conductor-a", 1, 1)
    assert (a.scheduler.num_own, b.scheduler.num_own) == (1, 0)

    b.scheduler.first_token("r1", ttft_s=0.2)
    assert prefill.prefill.num_pending == 0 and decode.decode.num_decoding == 1
    assert b.scheduler.errors.count == 0  # the peer reports its own prediction's error
    b.scheduler.finished("r1", num_output_tokens=8)
    assert ("r1" not in b.scheduler.admitted, decode.decode.num_records) == (True, 0)


def test_a_request_admitted_again_keeps_one_booking_and_never_a_peers_over_its_own():
    a, b = replica("conductor-a"), replica("conductor-b")
    a.scheduler.admit(request("r1"))
    late = a.shared("r1")
    b.on_peer_admission(late)
    b.scheduler.admit(request("r1"))  # the gateway asked again: b's own booking replaces a's
    record = b.scheduler.admitted["r1"]
    assert record.origin is None
    booked = [i.instance_id for i in b.scheduler.view.alive(Role.PREFILL) if i.prefill.num_pending]
    assert booked == [record.prefill_id]
    assert not b.on_peer_admission(late)
    assert b.scheduler.admitted["r1"].origin is None and b.num_peer_bookings == 1
