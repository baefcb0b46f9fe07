"""A worker counts as gone after its silence or a restart; one never heard from is not watched."""

import math

from libs.common.peers import PeerDirectory
from libs.protocol.schema import Heartbeat
from services.gateway.worker_watch import Gone, WorkerWatch


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def beat(instance_id: str, started_at: float = 1.0) -> Heartbeat:
    return Heartbeat(instance_id=instance_id, role="decode", host_id="h", started_at=started_at)


def setup() -> tuple[WorkerWatch, PeerDirectory, Clock]:
    clock = Clock()
    peers = PeerDirectory(clock=clock)
    return WorkerWatch(peers, silence=2.5), peers, clock


def test_silence_makes_a_watched_worker_gone_and_a_heartbeat_pushes_the_deadline_back():
    watch, peers, clock = setup()
    peers.observe(beat("d0"))
    watch.watch("d0", "decode")
    assert watch.seconds_to_next_check() == 2.5 and watch.gone() is None
    clock.now += 2.0
    peers.observe(beat("d0"))
    clock.now += 2.0
    assert watch.seconds_to_next_check() == 0.5 and watch.gone() is None
    clock.now += 0.5
    assert watch.seconds_to_next_check() == 0.0
    assert watch.gone() == Gone("d0", "decode", "no heartbeat for 2.5s", 1.0)


def test_a_restart_under_the_same_id_is_gone_at_once():
    watch, peers, clock = setup()
    peers.observe(beat("d0", started_at=1.0))
    watch.watch("d0", "decode")
    peers.observe(beat("d0", started_at=7.0))
    # gone is the process watched, not the one heard last: the restarted one may serve again
    assert watch.gone() == Gone("d0", "decode", "restarted", 1.0, restarted=True)
    assert watch.started_at("d0") == 1.0 and watch.started_at("d1") is None


def test_an_instance_never_heard_from_is_not_watched_and_unwatching_stops_watching():
    watch, peers, clock = setup()
    watch.watch("ghost", "prefill")
    peers.observe(beat("p0"))
    watch.watch("p0", "prefill")
    assert watch.watched == {"p0": "prefill"}
    watch.unwatch("p0")
    clock.now += 60
    assert watch.gone() is None and watch.seconds_to_next_check() == math.inf


def test_silence_while_the_gateway_itself_was_cut_off_from_nats_does_not_count():
    watch, peers, clock = setup()
    peers.observe(beat("d0"))
    watch.watch("d0", "decode")
    clock.now += 1.0
    peers.deaf()  # the gateway's own NATS connection is lost: nobody can be heard
    clock.now += 30.0
    assert watch.gone() is None and peers.alive("decode") != []
    peers.hearing()  # back: d0 was heard 1 s before the outage, and the outage is not its silence
    assert watch.gone() is None and watch.seconds_to_next_check() == 1.5
    clock.now += 1.5
    assert watch.gone() == Gone("d0", "decode", "no heartbeat for 2.5s", 1.0)
