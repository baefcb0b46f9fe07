"""Every policy's choice on hand-built cluster states: the instance picked, the
rejection and its reason, with predictions computed by hand from round-number
cost models (prefill 1 ms a token; decode steps of 10 ms + 1 ms a sequence)."""

import random

import pytest

from services.conductor.admission_policy import build_policy
from services.conductor.admitter import Admitter
from tests.unit.conductor.helpers import PROMPT, beat, cluster, coefficients, config, request


def scheduler(policy: str, *beats, ttft_s: float = 2.0, tbt_s: float = 0.15, rng=None):
    view, index, clock = cluster(*beats)
    return Admitter(build_policy(policy, rng), view, index, config(ttft_s, tbt_s)), index, clock


P0, P1, D0, D1 = beat("p0", "prefill"), beat("p1", "prefill"), beat("d0", "decode"), beat("d1", "decode")


def test_random_follows_its_seeded_generator():
    s, _, _ = scheduler("random", P0, P1, D0, D1, rng=random.Random(7))
    expected, picks = random.Random(7), []
    for i in range(6):
        d = s.admit(request(f"r{i}"))
        picks.append((d.prefill_id, d.decode_id))
    assert picks == [(f"p{expected.randrange(2)}", f"d{expected.randrange(2)}") for _ in range(6)]


def test_cache_aware_goes_where_the_prefix_is_until_its_queue_makes_the_other_faster():
    s, index, _ = scheduler("cache_aware", P0, P1, D0)
    index.add("p0", "device", PROMPT[:6])  # 96 of the 170 tokens
    # p0: queue + 74 tokens = 0.074 s a request; p1: 170 tokens = 0.170 s
    picks = [s.admit(request(f"r{i}")) for i in range(4)]
    assert [d.prefill_id for d in picks] == ["p0", "p0", "p1", "p0"]
    assert [d.predicted_ttft_s for d in picks] == pytest.approx([0.074, 0.148, 0.170, 0.222])
    assert picks[0].cached_tokens == {"device": 96} and picks[2].cached_tokens == {}


def test_a_first_token_settles_the_queue_it_was_predicted_in():
    s, index, clock = scheduler("cache_aware", P0, P1, D0)
    index.add("p0", "device", PROMPT[:6])
    s.admit(request("a"))
    s.admit(request("b"))
    clock.now = 0.1  # "a" took 0.1 s, not 0.074: "b" starts now
    s.first_token("a", ttft_s=0.1)
    assert s.view.get("p0").prefill.backlog(clock.now) == pytest.approx(0.074 - (0.1 - 0.074))
    assert s.errors.count == 1 and s.errors.sum == pytest.approx(0.1 - 0.074)
    s.finished("a")
    s.finished("b")
    assert s.view.get("p0").prefill.backlog(clock.now) == 0.0 and s.admitted == {}


def test_store_tiers_are_loaded_at_their_own_cost():
    store = beat("s0", "store", cost=coefficients(load_per_block={"dram": 0.001, "disk": 0.01}))
    s, index, _ = scheduler("cache_aware", P0, D0, store)
    index.add("p0", "device", PROMPT[:2])
    index.add("s0", "dram", PROMPT[:4])
    index.add("s0", "disk", PROMPT[4:8])
    d = s.admit(request())
    # blocks 2-3 from dram, 4-7 from disk, 42 tokens computed
    assert d.cached_tokens == {"device": 32, "dram": 32, "disk": 64}
    assert d.predicted_ttft_s == pytest.approx(2 * 0.001 + 4 * 0.01 + 0.042)


def test_replication_copies_a_busy_peers_prefix_to_an_idle_instance():
    cheap_copies = coefficients(transfer_per_block=0.0001)
    beats = (beat("p0", "prefill", cost=cheap_copies), beat("p1", "prefill", cost=cheap_copies), D0)
    handoff = 11 * 0.0001  # the prompt's 11 blocks to the decode worker
    for policy, expected in [("cache_aware", (None, 0, {"device": 16}, 0.154 + handoff)),
                             ("cache_aware+replication", ("p0", 9, {"device": 16, "peer": 144}, 0.0009 + 0.010 + handoff))]:  # fmt: skip
        s, index, _ = scheduler(policy, *beats)
        index.add("p0", "device", PROMPT)
        index.add("p1", "device", PROMPT[:1])
        s.view.get("p0").prefill.add("busy", 1.0, 0.0)  # p0 holds the whole prefix but is busy for 1 s
        d = s.admit(request())
        assert d.prefill_id == "p1"
        assert (d.copy_from, d.copy_blocks, d.cached_tokens) == expected[:3]
        assert d.predicted_ttft_s == pytest.approx(expected[3])


def test_replication_stays_below_the_balancing_threshold():
    s, index, _ = scheduler("cache_aware+replication", P0, P1, D0)
    index.add("p0", "device", PROMPT[:3])
    index.add("p1", "device", PROMPT[:2])  # 3 < 2 x 2: not worth a copy
    s.view.get("p0").prefill.add("busy", 1.0, 0.0)
    d = s.admit(request())
    assert (d.prefill_id, d.copy_from, d.cached_tokens) == ("p1", None, {"device": 32})


def test_cache_aware_picks_the_decode_instance_with_the_least_predicted_tbt():
    s, _, _ = scheduler("cache_aware", P0, beat("d0", "decode", batch_size=3), beat("d1", "decode", batch_size=1))
    d = s.admit(request())
    assert (d.decode_id, d.predicted_tbt_s) == ("d1", pytest.approx(0.012))


def test_early_rejection_refuses_what_would_queue_past_the_ttft_slo():
    s, index, _ = scheduler("cache_aware+early_rejection", P0, D0, ttft_s=0.2)
    index.add("p0", "device", PROMPT[:6])
    first, second, third = (s.admit(request(f"r{i}")) for i in range(3))
    assert first.admitted and second.admitted
    assert (third.error_code, third.reason) == ("rejected", "ttft_slo")
    assert third.retry_after_s == pytest.approx(0.222 - 0.2)
    assert third.predicted_ttft_s == pytest.approx(0.222)
    assert third.error_message == "predicted TTFT 0.222 s on p0 (queue 0.148 s) exceeds the 0.200 s target"
    assert s.rejections == {"ttft_slo": 1} and s.num_admitted == 2


def test_a_request_over_the_slo_by_itself_is_refused_at_once_unless_best_effort_or_moved():
    s, _, _ = scheduler("cache_aware+early_rejection", P0, D0, ttft_s=0.1)
    hopeless = s.admit(request("a"))  # 0.170 s even alone
    assert (hopeless.admitted, hopeless.reason, hopeless.retry_after_s) == (False, "slo_unattainable", None)
    assert "best effort" in hopeless.error_message
    best_effort = s.admit(request("b", best_effort=True))
    assert best_effort.admitted and best_effort.best_effort
    moved = s.admit(request("c", moved=True))  # a moved request is never refused
    assert moved.admitted
    assert s.view.get("p0").prefill.num_pending == 2


def test_a_short_prompt_is_predicted_ahead_of_a_long_one_but_never_past_an_earlier_promise():
    s, _, _ = scheduler("cache_aware+early_rejection", P0, D0, ttft_s=2.0)
    s.view.get("p0").prefill.chunk_s = 0.05  # the worker cuts a prompt every 50 ms
    long = s.admit(request("long", tokens=1500, blocks=[]))  # 1.5 s: on time with 0.5 s to spare
    assert long.admitted and long.predicted_ttft_s == pytest.approx(1.5)
    short = s.admit(request("short", tokens=40, blocks=[]))  # goes first, after the chunk in progress
    assert short.admitted and short.predicted_ttft_s == pytest.approx(0.05 + 0.04)
    many = [s.admit(request(f"s{i}", tokens=100, blocks=[])) for i in range(6)]
    # each 0.1 s: four more fit into the long prompt's slack (0.5 - 0.04 - 0.05 chunk...), then the rest
    # would make "long" late: refused, naming it
    refused = [d for d in many if not d.admitted]
    assert refused and all(d.reason == "ttft_slo" for d in refused)
    assert any("long" in d.error_message for d in refused) or all("exceeds" in d.error_message for d in refused)


@pytest.mark.parametrize("batch_size, admitted", [(4, True), (5, False)])
def test_early_rejection_refuses_what_would_push_the_decode_batch_past_the_tbt_slo(batch_size, admitted):
    # 10 ms + 1 ms x 5 sequences = 15 ms: the target exactly; 6 sequences: 16 ms
    s, _, _ = scheduler("cache_aware+early_rejection", P0, beat("d0", "decode", batch_size=batch_size), tbt_s=0.015)
    d = s.admit(request())
    assert d.admitted is admitted
    if not admitted:
        assert (d.reason, d.predicted_tbt_s) == ("tbt_slo", pytest.approx(0.016))
        assert d.error_message == "predicted TBT 16.0 ms on d0 (batch 6) exceeds the 15.0 ms target"


def test_prediction_based_rejection_counts_the_requests_still_in_prefill():
    beats = (P0, D0)
    plain, _, _ = scheduler("cache_aware+early_rejection", *beats, tbt_s=0.015)
    predictive, _, _ = scheduler("cache_aware+predictive_rejection", *beats, tbt_s=0.015)
    for s in (plain, predictive):
        # five in prefill, none decoding yet, each decoding long after the next one's prefill
        assert all(s.admit(request(f"r{i}", max_tokens=1000)).admitted for i in range(5))
    assert plain.admit(request("late", max_tokens=1000)).admitted  # it sees an empty batch
    late = predictive.admit(request("late", max_tokens=1000))  # it sees the five landing first
    assert (late.reason, late.predicted_tbt_s) == ("tbt_slo", pytest.approx(0.016))


def test_prediction_based_rejection_counts_requests_finishing_before_the_prefill_does():
    s, _, clock = scheduler("cache_aware+predictive_rejection", P0, D0, tbt_s=0.015)
    for i in range(5):
        s.admit(request(f"r{i}", tokens=20, blocks=[], max_tokens=1))  # one token each: done within a step
        s.first_token(f"r{i}")
    assert s.admit(request("long")).admitted  # 170 ms of prefill: the five are gone by then


def test_a_request_whose_kv_cannot_fit_the_decode_pool_is_refused():
    s, _, _ = scheduler("cache_aware+early_rejection", P0, beat("d0", "decode", capacity=10))  # 160 tokens
    d = s.admit(request())
    assert (d.error_code, d.reason) == ("rejected", "decode_full")


def test_conditional_disaggregation_prefills_a_short_prompt_on_the_decode_worker():
    decode = beat("d0", "decode", cost=coefficients(prefill_per_token=0.0005))
    s, _, _ = scheduler("cache_aware+local_prefill", P0, decode)
    s.view.get("p0").prefill.add("busy", 1.0, 0.0)
    short = s.admit(request("short", tokens=20, blocks=[]))
    assert (short.prefill_on_decode, short.prefill_id, short.decode_id) == (True, "d0", "d0")
    assert short.predicted_ttft_s == pytest.approx(0.010)
    long = s.admit(request("long", tokens=600, blocks=[]))  # 0.3 s would stall the batch past its 150 ms target
    assert (long.prefill_on_decode, long.prefill_id) == (False, "p0")


def test_local_prefills_stop_where_the_batch_decoding_beside_them_would_miss_its_tbt():
    # 0.5 ms a token: each 100-token prompt is 50 ms of prefill, sooner on d0 than behind p0's 1 s
    decode = beat("d0", "decode", cost=coefficients(prefill_per_token=0.0005))
    s, _, _ = scheduler("cache_aware+local_prefill", P0, decode, tbt_s=0.08)
    s.view.get("p0").prefill.add("busy", 1.0, 0.0)
    picks = [s.admit(request(f"r{i}", tokens=100, blocks=[])) for i in range(12)]
    # r0's 9 gaps may take 9 x (80 ms - step) of stall beside it, steps of 10 ms + 1 ms a member:
    # r11's would leave it 9 x (80 - 22) - 10 x 50 = 22 ms, less than its 50: it goes to p0
    assert [d.prefill_on_decode for d in picks] == [True] * 11 + [False]
    assert all(d.admitted for d in picks) and picks[-1].prefill_id == "p0"
    assert s.view.get("d0").decode.records["r0"].stall_s == pytest.approx(10 * 0.050)


def test_a_decode_worker_that_prefills_in_chunks_takes_a_prompt_longer_than_one_tbt():
    # 0.5 ms a token, 100 tokens between two decode steps: a 50 ms chunk, 60 ms with the step
    decode = beat("d0", "decode", cost=coefficients(prefill_per_token=0.0005), chunk_tokens=100, batch_size=1)
    s, _, _ = scheduler("cache_aware+local_prefill", P0, decode)
    assert s.view.get("d0").prefill.chunk_s == pytest.approx(0.050)
    s.view.get("p0").prefill.add("busy", 1.0, 0.0)
    long = s.admit(request("long", tokens=600, blocks=[]))  # 0.3 s of prefill, cut in 6 chunks
    assert (long.prefill_on_decode, long.prefill_id, long.decode_id) == (True, "d0", "d0")
    # the 5 decode steps (11 ms: one sequence) between its chunks come on top of its compute
    assert long.predicted_ttft_s == pytest.approx(0.300 + 5 * 0.011)
    chunky = beat("d1", "decode", cost=coefficients(prefill_per_token=0.0005), chunk_tokens=300, batch_size=1)
    s, _, _ = scheduler("cache_aware+local_prefill", P0, chunky)  # a 150 ms chunk: past the target with the step
    s.view.get("p0").prefill.add("busy", 1.0, 0.0)
    assert s.admit(request("long", tokens=600, blocks=[])).prefill_id == "p0"


@pytest.mark.parametrize("spec, message", [
    ("fastest", "unknown policy 'fastest'"),
    ("cache_aware+magic", "unknown policy option 'magic'"),
    ("least_loaded+replication", "replication needs the cache_aware router"),
    ("cache_aware+early_rejection+predictive_rejection", "choose early_rejection or predictive_rejection"),
])  # fmt: skip
def test_policy_specs_are_validated(spec, message):
    with pytest.raises(ValueError, match=message):
        build_policy(spec)


def test_per_request_slos_override_the_defaults():
    s, _, _ = scheduler("cache_aware+early_rejection", P0, D0)
    assert s.admit(request("a")).admitted
    d = s.admit(request("b", slo_ttft_s=0.2))
    assert (d.reason, d.retry_after_s) == ("ttft_slo", pytest.approx(0.34 - 0.2))


def test_early_and_predictive_rejection_part_where_the_decode_batch_changes_during_prefills():
    # decode steps of 10 ms + 1 ms a sequence against a 30 ms TBT target: 20 sequences fit
    policies = ("cache_aware+early_rejection", "cache_aware+predictive_rejection")
    # filling: 20 long requests queued at p0 (0.17 s each) and none decoding yet. Early rejection sees
    # an empty batch; predictive sees the 20 that will be decoding when the 21st's prefill ends
    decisions = {}
    for policy in policies:
        s, _, _ = scheduler(policy, P0, D0, ttft_s=100.0, tbt_s=0.03)
        for i in range(20):
            assert s.admit(request(f"r{i}", blocks=[], max_tokens=1000)).admitted
        decisions[policy] = s.admit(request("r20", blocks=[], max_tokens=1000))
    assert decisions["cache_aware+early_rejection"].admitted
    assert decisions["cache_aware+predictive_rejection"].reason == "tbt_slo"
    # draining: 20 sequences decoding now, each 5 tokens from its end; a 1,000-token prompt
    # (1 s of prefill) joins a batch that will have emptied by then
    for policy in policies:
        s, _, clock = scheduler(policy, P0, D0, ttft_s=100.0, tbt_s=0.03)
        for i in range(20):
            s.admit(request(f"r{i}", tokens=17, blocks=[], max_tokens=5))
        clock.now = 1.0
        for i in range(20):
            s.first_token(f"r{i}")
        decisions[policy] = s.admit(request("long", tokens=1000, blocks=[]))
    assert decisions["cache_aware+early_rejection"].reason == "tbt_slo"
    assert decisions["cache_aware+predictive_rejection"].admitted


def test_a_session_stays_where_its_kv_is_until_moving_is_predicted_cheaper():
    s, index, _ = scheduler("least_loaded", P0, P1, D0)
    index.add("p0", "device", PROMPT[:6])  # the conversation so far: 96 of the 170 tokens, on p0
    first = s.admit(request("t1", session_id="chat-1"))
    assert (first.prefill_id, first.affinity) == ("p0", None)  # a new session: the router's choice
    # least_loaded alone now picks p1 (p0 has a request), as it does for a request of no session;
    # the session stays: p0 answers sooner (0.074 s queued + 0.074 s against 0.170 s)
    assert build_policy("least_loaded").choose(s.context(request("x"))).prefill_id == "p1"
    second = s.admit(request("t2", session_id="chat-1"))
    assert second.prefill_id == "p0"
    assert second.affinity == "prefill kept on p0 (predicted TTFT 0.148 s, 0.170 s on p1); decode kept on d0"
    third = s.admit(request("t3", session_id="chat-1"))  # p0: 0.222 s now
    assert third.prefill_id == "p1"
    assert third.affinity == ("prefill moved from p0 to p1: predicted TTFT 0.170 s there, 0.222 s on p0; "
                              "decode kept on d0")  # fmt: skip
    assert s.sessions.get("chat-1").prefill_id == "p1"  # its next turn starts from there
