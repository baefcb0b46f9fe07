"""The conductor's cluster view and least-loaded policy, on hand-built states."""

from libs.common.schema import AdmitRequest, Heartbeat
from services.conductor.cluster import ClusterView
from services.conductor.policies import LeastLoaded

REQUEST = AdmitRequest(request_id="r", num_prompt_tokens=10, max_tokens=5)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def beat(instance_id: str, role: str, load: int = 0, free: int = 100) -> Heartbeat:
    return Heartbeat(instance_id=instance_id, role=role, host_id="h", load=load, free_blocks=free)


def test_an_instance_silent_for_three_seconds_is_gone():
    clock = Clock()
    view = ClusterView(timeout=3.0, clock=clock)
    view.observe(beat("p1", "prefill"))
    clock.now += 2.9
    assert [i.instance_id for i in view.alive("prefill")] == ["p1"]
    clock.now += 0.2
    assert view.alive("prefill") == []


def test_missing_roles_are_named():
    view = ClusterView(clock=Clock())
    policy = LeastLoaded()
    assert policy.choose(REQUEST, view).error_code == "no_instances"
    view.observe(beat("d1", "decode"))
    decision = policy.choose(REQUEST, view)
    assert (decision.error_code, decision.error_message) == ("no_prefill", "no prefill instance is alive")
    view = ClusterView(clock=Clock())
    view.observe(beat("p1", "prefill"))
    assert policy.choose(REQUEST, view).error_message == "no decode instance is alive"


def test_least_loaded_then_most_free_blocks_then_id():
    view = ClusterView(clock=Clock())
    for hb in (beat("p1", "prefill", load=2), beat("p2", "prefill", load=1), beat("p3", "prefill", load=1, free=200),
               beat("d1", "decode", load=0), beat("d2", "decode", load=0)):  # fmt: skip
        view.observe(hb)
    decision = LeastLoaded().choose(REQUEST, view)
    assert (decision.prefill_id, decision.decode_id) == ("p3", "d1")


def test_assignments_between_heartbeats_spread_a_burst():
    view = ClusterView(clock=Clock())
    for hb in (beat("p1", "prefill"), beat("p2", "prefill"), beat("d1", "decode"), beat("d2", "decode")):
        view.observe(hb)
    picks = []
    for _ in range(4):
        decision = LeastLoaded().choose(REQUEST, view)
        view.assigned(decision.prefill_id)
        view.assigned(decision.decode_id)
        picks.append((decision.prefill_id, decision.decode_id))
    assert picks == [("p1", "d1"), ("p2", "d2"), ("p1", "d1"), ("p2", "d2")]
    view.observe(beat("p1", "prefill", load=0))  # a fresh heartbeat replaces the estimate
    assert view.alive("prefill")[0].load == 0
