"""The conductor's cluster view and least-loaded routing, on hand-built states."""

from libs.engine.cost_model import uncalibrated_coefficients
from services.conductor.admission_policy import build_policy
from services.conductor.admitter import Admitter
from tests.unit.conductor.helpers import beat, cluster, config, request


def test_an_instance_silent_for_three_seconds_is_gone_and_reported():
    view, _, clock = cluster(beat("p1", "prefill"))
    gone = []
    view.on_gone = lambda inst: gone.append(inst.instance_id)
    clock.now += 2.9
    assert [i.instance_id for i in view.alive("prefill")] == ["p1"]
    clock.now += 0.2
    assert view.alive("prefill") == []
    assert gone == ["p1"]


def test_an_instance_without_a_calibration_gets_the_stand_in_at_its_block_size():
    view, _, _ = cluster(beat("p1", "prefill", cost=None))
    assert view.get("p1").cost.coefficients == uncalibrated_coefficients(16)


def test_missing_roles_are_named():
    view, index, _ = cluster()
    scheduler = Admitter(build_policy("least_loaded"), view, index, config())
    assert scheduler.admit(request()).error_code == "no_instances"
    view, index, clock = cluster(beat("p1", "prefill"))
    scheduler = Admitter(build_policy("least_loaded"), view, index, config())
    clock.now += 5.0  # p1 falls silent
    view.observe(beat("d1", "decode"))
    decision = scheduler.admit(request())
    assert (decision.error_code, decision.error_message) == ("no_prefill", "no prefill instance is alive")
    view, index, _ = cluster(beat("p1", "prefill"))
    assert Admitter(build_policy("least_loaded"), view, index).admit(request()).error_message == (
        "no decode instance is alive"
    )


def test_least_loaded_then_most_free_blocks_then_id():
    view, index, _ = cluster(beat("p1", "prefill", load=2), beat("p2", "prefill", load=1),
                             beat("p3", "prefill", load=1, free=200), beat("d1", "decode"), beat("d2", "decode"))  # fmt: skip
    decision = Admitter(build_policy("least_loaded"), view, index).admit(request())
    assert (decision.prefill_id, decision.decode_id) == ("p3", "d1")


def test_assignments_between_heartbeats_spread_a_burst():
    view, index, _ = cluster(beat("p1", "prefill"), beat("p2", "prefill"), beat("d1", "decode"), beat("d2", "decode"))
    scheduler = Admitter(build_policy("least_loaded"), view, index)
    picks = []
    for i in range(4):
        decision = scheduler.admit(request(f"r{i}"))
        picks.append((decision.prefill_id, decision.decode_id))
    assert picks == [("p1", "d1"), ("p2", "d2"), ("p1", "d1"), ("p2", "d2")]
    view.observe(beat("p1", "prefill", load=0))  # a fresh heartbeat replaces the estimate
    assert view.get("p1").load == 0


def test_an_idle_heartbeat_clears_predicted_work_only_when_nothing_was_sent_since():
    view, index, clock = cluster(beat("p1", "prefill"), beat("d1", "decode"))
    scheduler = Admitter(build_policy("cache_aware"), view, index)
    scheduler.admit(request("a"))
    view.observe(beat("p1", "prefill", load=0))  # sent before "a" arrived: the work stays
    assert view.get("p1").prefill.backlog(clock.now) == 0.17
    view.observe(beat("p1", "prefill", load=0))  # idle, and nothing sent since the last one
    assert view.get("p1").prefill.backlog(clock.now) == 0.0


def test_a_restarted_instance_starts_from_a_clean_slate():
    view, index, clock = cluster(beat("p1", "prefill", started_at=1.0), beat("d1", "decode"))
    Admitter(build_policy("cache_aware"), view, index).admit(request("a"))
    assert view.get("p1").prefill.num_pending == 1
    view.observe(beat("p1", "prefill", started_at=2.0))
    assert view.get("p1").prefill.num_pending == 0



def test_a_beat_sent_again_marks_its_instance_heard_and_the_silent_are_still_found():
    again = beat("p1", "prefill")
    view, _, clock = cluster(again, beat("p2", "prefill"))
    clock.now = 2.0
    view.observe_all([again])
    clock.now = 3.5  # p2 last heard 3.5 s ago, p1 1.5 s ago
    assert [i.instance_id for i in view.alive("prefill")] == ["p1"]
    clock.now = 5.5
    assert view.alive("prefill") == []


def test_the_instance_heard_from_longest_ago_goes_first_however_it_was_heard():
    view, _, clock = cluster(beat("p1", "prefill"), beat("p2", "prefill"), beat("p3", "prefill"))
    clock.now = 1.0
    view.observe(beat("p1", "prefill", load=1))  # a new beat
    clock.now = 2.0
    view.observe(beat("p2", "prefill", started_at=5.0))  # p2 started again
    clock.now = 3.5  # p3 last heard 3.5 s ago
    assert [i.instance_id for i in view.alive("prefill")] == ["p1", "p2"]
    clock.now = 4.5
    assert [i.instance_id for i in view.alive("prefill")] == ["p2"]
    clock.now = 5.5
    assert view.alive("prefill") == []


def test_a_beat_sent_again_after_a_request_was_sent_is_observed_in_full():
    again = beat("p1", "prefill")
    view, _, _ = cluster(again)
    view.assigned("p1")
    assert view.get("p1").load == 1
    view.observe_all([again])
    assert view.get("p1").load == 0  # the beat counts what was sent since


def test_instances_reporting_the_same_coefficients_share_one_cost_model():
    view, _, _ = cluster(beat("p1", "prefill"), beat("p2", "prefill"), beat("d1", "decode"))
    assert view.get("p1").cost is view.get("p2").cost is view.get("d1").cost


def test_no_instance_is_forgotten_for_the_silence_of_the_conductors_own_nats_outage():
    view, _, clock = cluster(beat("p1", "prefill"))
    gone = []
    view.on_gone = lambda inst: gone.append(inst.instance_id)
    clock.now += 2.0
    view.deaf()
    clock.now += 20.0
    assert [i.instance_id for i in view.alive("prefill")] == ["p1"]
    view.hearing()
    clock.now += 0.9  # 2.9 s of silence the conductor could have heard
    assert [i.instance_id for i in view.alive("prefill")] == ["p1"]
    clock.now += 0.2
    assert view.alive("prefill") == [] and gone == ["p1"]
