"""A cluster with no prefill instance: one that never had any, or any with
``+local_prefill``, has every request prefilled by its decode instance and judged
with the stall that prefill costs the batch; one whose prefill instances are gone,
without ``+local_prefill``, refuses until one is back. Round-number cost models (tests/unit/conductor/helpers.py):
prefill 1 ms a token, decode steps of 10 ms + 1 ms a sequence; max_tokens 10, so a
stall spreads over 10 tokens."""

import pytest

from services.conductor.admission_policy import build_policy
from services.conductor.admitter import Admitter
from tests.unit.conductor.helpers import beat, cluster, config, request

D0, D1 = beat("d0", "decode"), beat("d1", "decode")


def scheduler(policy: str, *beats, tbt_s: float = 0.15) -> Admitter:
    view, index, _ = cluster(*beats)
    return Admitter(build_policy(policy), view, index, config(ttft_s=100.0, tbt_s=tbt_s))


POLICIES = ["cache_aware", "cache_aware+predictive_rejection", "least_loaded"]


@pytest.mark.parametrize("policy", POLICIES)
def test_a_cluster_that_never_had_a_prefill_instance_prefills_on_decode_whatever_the_policy(policy):
    s = scheduler(policy, D0)
    d = s.admit(request())
    assert (d.admitted, d.prefill_on_decode, d.prefill_id, d.decode_id) == (True, True, "d0", "d0")
    assert s.policy.prefills_on_decode(s.view)


@pytest.mark.parametrize("policy", POLICIES)
def test_without_local_prefill_prefill_instances_gone_means_no_route_until_one_is_back(policy):
    s = scheduler(policy, beat("p0", "prefill"), D0)
    assert not s.policy.prefills_on_decode(s.view)
    s.view.clock.now = 5.0  # past the 3 s timeout: p0 is silent, d0 still beats
    s.view.observe(D0)
    d = s.admit(request("a"))
    assert (d.admitted, d.error_code) == (False, "no_prefill")
    s.view.observe(beat("p1", "prefill"))
    assert s.admit(request("b")).prefill_id == "p1"


def test_without_any_decode_instance_local_prefill_has_no_route_either():
    d = scheduler("cache_aware+local_prefill").admit(request())
    assert d.error_code == "no_instances"


@pytest.mark.parametrize("router", ["random", "least_loaded", "cache_aware"])
def test_every_request_is_prefilled_on_the_decode_instance_however_long(router):
    s = scheduler(f"{router}+local_prefill", D0)
    # 170 ms of prefill: past the 150 ms TBT target, where a prefill instance would be preferred
    first = s.admit(request("a"))
    assert (first.admitted, first.prefill_on_decode, first.prefill_id, first.decode_id) == (True, True, "d0", "d0")
    assert first.predicted_ttft_s == pytest.approx(0.170)
    # one sequence (11 ms steps) stalled by its own 170 ms prefill over its 10 tokens
    assert first.predicted_tbt_s == pytest.approx(0.011 + 0.170 / 10)
    second = s.admit(request("b"))  # queued behind the first one's prefill
    assert second.predicted_ttft_s == pytest.approx(0.340)
    assert second.predicted_tbt_s == pytest.approx(0.012 + 0.340 / 10)
    assert s.view.get("d0").prefill.backlog(0.0) == pytest.approx(0.340)  # both booked on d0's own queue


def test_the_stall_of_local_prefills_can_refuse_a_request_the_decode_batch_alone_would_take():
    s = scheduler("cache_aware+local_prefill+predictive_rejection", D0, tbt_s=0.03)
    assert s.admit(request("a")).admitted  # 11 ms + 17 ms of stall: within 30 ms
    # "b"'s 170 ms prefill would run while "a" decodes: a's 9 gaps at 12 ms steps have 9 x 18 ms
    # = 162 ms of stall left before its mean passes 30 ms
    late = s.admit(request("b"))
    assert (late.reason, late.prefill_on_decode) == ("tbt_slo", True)
    assert "would make a request decoding there miss its TBT target (0.162 s of stall left)" in late.error_message


def test_every_local_prefill_booked_beside_a_request_counts_against_its_tbt_promise():
    s = scheduler("cache_aware+local_prefill+predictive_rejection", D0, tbt_s=0.05)
    assert s.admit(request("a", tokens=60, blocks=[])).admitted
    # each 60 ms prefill stalls "a" (9 gaps, 50 ms target, steps of 10 ms + 1 ms a member): the
    # sixth would leave it 9 x (50 - 17) - 5 x 60 = -3 ms, the booked stalls added up
    admitted = [s.admit(request(f"r{i}", tokens=60, blocks=[])) for i in range(6)]
    assert [d.admitted for d in admitted] == [True] * 5 + [False]
    assert "(0.000 s of stall left)" in admitted[-1].error_message
    assert s.view.get("d0").decode.records["a"].stall_s == pytest.approx(5 * 0.060)


def test_a_prompt_whose_own_stall_misses_the_target_is_served_alone_not_refused_forever():
    s = scheduler("cache_aware+local_prefill+predictive_rejection", D0, tbt_s=0.03)
    alone = s.admit(request("long", tokens=1000, blocks=[]))  # 11 ms + 100 ms of stall a token
    assert (alone.admitted, alone.best_effort) == (True, True)
    assert not s.admit(request("next", tokens=1000, blocks=[])).admitted  # not beside another


def test_cache_aware_sends_each_request_to_the_decode_instance_whose_prefill_queue_is_shortest():
    s = scheduler("cache_aware+local_prefill", D0, D1)
    picks = [s.admit(request(f"r{i}", tokens=100 * (i + 1), blocks=[])) for i in range(3)]
    # r0 (0.1 s) on d0; r1 (0.2 s) on d1, idle; r2 behind r0's 0.1 s on d0, not r1's 0.2 s on d1
    assert [d.decode_id for d in picks] == ["d0", "d1", "d0"]
    assert all(d.prefill_id == d.decode_id and d.prefill_on_decode for d in picks)
    assert picks[2].predicted_ttft_s == pytest.approx(0.1 + 0.3)


def test_a_session_keeps_its_decode_instance_and_its_prefill_there():
    s = scheduler("least_loaded+local_prefill", D0, D1)
    first = s.admit(request("t1", session_id="chat"))
    assert first.decode_id == "d0"
    s.admit(request("other"))  # least_loaded alone would now pick d1
    second = s.admit(request("t2", session_id="chat"))
    assert (second.prefill_id, second.decode_id, second.prefill_on_decode) == ("d0", "d0", True)
    assert second.predicted_ttft_s == pytest.approx(0.170 + 0.170)  # behind t1's prefill, not "other"'s on d1
    assert second.affinity.startswith("last turn prefilled on its decode worker d0; decode kept on d0")
