"""The console's view of the conductor: every decision with what was predicted on
each candidate (the numbers the policy weighed, before its load was booked), the
rejections and why, the reused prefixes and where their copies are."""

import pytest

from libs.protocol import schema
from libs.protocol.schema import ConductorViewReply
from libs.protocol.slo import SLO
from services.conductor.admission_policy import build_policy
from services.conductor.admitter import Admitter
from services.conductor.explain import WATCHED_S, DecisionLog
from tests.unit.conductor.helpers import PROMPT, beat, cluster, config, request

P0, P1, D0 = beat("p0", "prefill"), beat("p1", "prefill"), beat("d0", "decode")


def explained(policy: str, *beats, ttft_s: float = 2.0):
    view, index, clock = cluster(*beats)
    s = Admitter(build_policy(policy), view, index, config(ttft_s=ttft_s))
    log = DecisionLog(policy, clock=lambda: 1000.0)
    s.explain = log.record
    log.view("conductor-0", index, SLO(), 0, 0)  # a console watches
    return s, index, log


def test_decisions_keep_their_candidates_only_while_a_console_watches():
    view, index, _ = cluster(P0, P1, D0)
    s = Admitter(build_policy("cache_aware"), view, index, config())
    now = [1000.0]
    log = DecisionLog("cache_aware", clock=lambda: now[0])
    s.explain = log.record
    s.admit(request("unwatched"))
    log.view("conductor-0", index, SLO(), 10, 10)
    s.admit(request("watched"))
    now[0] += WATCHED_S + 1  # no console asked since
    s.admit(request("forgotten"))
    counts = {d.request_id: len(d.candidates) for d in log.decisions(10)}
    assert counts == {"unwatched": 0, "watched": 3, "forgotten": 0}
    assert all(d.prefill_id and d.decode_id for d in log.decisions(10))  # the choice itself is always kept


def test_each_decision_keeps_every_candidates_prediction_as_weighed():
    s, index, log = explained("cache_aware", P0, P1, D0)
    index.add("p0", "device", PROMPT[:6])  # 96 of the 170 tokens
    s.admit(request("r0"))
    s.admit(request("r1"))  # p0 now has r0 queued: 0.074 s ahead
    newest, oldest = log.decisions(10)
    assert (newest.request_id, oldest.request_id) == ("r1", "r0")
    assert (oldest.prefill_id, oldest.decode_id, oldest.policy, oldest.at) == ("p0", "d0", "cache_aware", 1000.0)
    assert oldest.predicted_ttft_s == pytest.approx(0.074) and oldest.cached_tokens == {"device": 96}
    prefills = {c.instance_id: c for c in oldest.candidates if c.role == "prefill"}
    assert prefills["p0"].predicted_ttft_s == pytest.approx(0.074) and prefills["p0"].cached_tokens == 96
    assert prefills["p1"].predicted_ttft_s == pytest.approx(0.170) and prefills["p1"].cached_tokens == 0
    (decode,) = [c for c in oldest.candidates if c.role == "decode"]
    assert (decode.instance_id, decode.batch_size) == ("d0", 1)
    assert decode.predicted_tbt_s == pytest.approx(0.011)  # 10 ms + 1 ms for its one sequence
    queued = {c.instance_id: c for c in newest.candidates if c.role == "prefill"}
    assert queued["p0"].queue_s == pytest.approx(0.074) and queued["p0"].predicted_ttft_s == pytest.approx(0.148)
    assert oldest.rejected is None and log.decisions(1) == [newest]


def test_a_sessions_turn_says_whether_it_stayed_home():
    s, _, log = explained("cache_aware", P0, P1, D0)
    s.admit(request("turn-1", session_id="chat-7"))
    s.admit(request("turn-2", session_id="chat-7"))
    second, first = log.decisions(2)
    assert first.affinity is None  # the first turn has no home yet
    assert "decode kept on d0" in second.affinity  # the policy's own words


def test_a_rejection_says_which_target_and_why():
    s, _, log = explained("cache_aware+early_rejection", P0, D0, ttft_s=0.3)
    s.admit(request("r0"))  # alone on an idle cluster: 0.17 s
    s.admit(request("r1"))  # behind it: 0.34 s predicted
    rejected = log.decisions(1)[0]
    assert rejected.request_id == "r1" and rejected.rejected == "ttft_slo"
    assert "predicted TTFT 0.340 s on p0" in rejected.why


def test_the_view_counts_the_kv_map_and_ranks_reused_prefixes_with_their_holders():
    s, index, log = explained("cache_aware", P0, P1, D0)
    index.add("p0", "device", PROMPT[:6])
    index.add("s0", "dram", PROMPT[:3])
    index.add("s0", "disk", PROMPT[:8])
    for i in range(3):
        s.admit(request(f"a{i}"))  # the 8-block prefix, held by s0 (on disk)
    s.admit(request("b", blocks=PROMPT[:3] + [b"x" * 16]))  # a 3-block one
    s.admit(request("c", blocks=[b"y" * 16] * 4))  # nothing held: not a reused prefix
    view = log.view("conductor-0", index, SLO(), max_decisions=2, max_prefixes=5)
    assert view.blocks == {"p0": {"device": 6}, "s0": {"dram": 3, "disk": 8}}
    assert [(p.block_hash, p.num_blocks, p.hits) for p in view.hot_prefixes] == [
        (PROMPT[7].hex(), 8, 3), (PROMPT[2].hex(), 3, 1)]  # fmt: skip
    assert view.hot_prefixes[0].holders == {"s0": "disk"}
    assert view.hot_prefixes[1].holders == {"p0": "device", "s0": "dram"}  # the fastest tier of each holder
    assert [d.request_id for d in view.decisions] == ["c", "b"]
    assert (view.slo_ttft_s, view.slo_tbt_s, view.policy) == (2.0, 0.15, "cache_aware")
    assert schema.decode(schema.encode(view), ConductorViewReply) == view  # it crosses NATS as is
