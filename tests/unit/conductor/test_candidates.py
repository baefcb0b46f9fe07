"""Candidate pruning (`services/conductor/candidates.py`): a router looks at the
prompt's holders, the busy instances and the best idle one per bucket, and picks
what it would have picked among every instance."""

import random

from libs.protocol.vocabulary import Role
from services.conductor.admission_policy import build_policy
from services.conductor.admitter import Admitter
from services.conductor.candidates import Candidates
from services.conductor.margin import Margins
from services.conductor.simulator.scenarios import hot_prefix
from services.conductor.simulator.simulation import SimConfig, Simulation
from tests.unit.conductor.helpers import beat, cluster, coefficients, config, request


def ids(instances) -> list[str]:
    return sorted(i.instance_id for i in instances)


def test_of_many_idle_instances_only_the_least_loaded_then_smallest_id_is_looked_at():
    view, _, _ = cluster(*(beat(f"p{i:02}", "prefill", load=(i * 7) % 5 + 1) for i in range(40)))
    view.observe(beat("p33", "prefill", load=0))
    view.observe(beat("p17", "prefill", load=0))
    candidates = Candidates(view, Margins())
    assert ids(candidates.prefill.candidates()) == ["p17"]


def test_of_the_idle_holders_only_those_holding_more_than_the_best_idle_instance_are_read():
    view, _, _ = cluster(*(beat(f"p{i}", "prefill", load=i) for i in range(8)))
    candidates = Candidates(view, Margins())
    held = {"p1": 2, "p2": 4, "p3": 4, "p4": 7, "p6": 7, "p7": 2}
    holders = [(7, ["p4", "p6"]), (4, ["p2", "p3"]), (2, ["p1", "p7"])]
    # p0 holds nothing but ranks first: every holder outranks it by holding more (the best of each length)
    assert ids(candidates.prefill.candidates(holders, lambda i: held.get(i, 0))) == ["p0", "p1", "p2", "p4"]
    # p1 ranks first and holds 2 blocks: p7 (also 2) is read no more
    assert ids(candidates.prefill.candidates(holders, lambda i: held.get(i, 0), skip={"p0"})) == ["p1", "p2", "p4"]


def test_with_replication_every_holder_length_and_the_best_of_the_rest_are_read():
    view, _, _ = cluster(*(beat(f"p{i}", "prefill", load=i) for i in range(8)))
    candidates = Candidates(view, Margins())
    holders = [(7, ["p4", "p6"]), (4, ["p2", "p3"]), (2, ["p0", "p7"])]
    assert ids(candidates.prefill.candidates(holders, monotone=False)) == ["p0", "p1", "p2", "p4"]


def test_a_heartbeat_that_lowers_a_load_makes_that_instance_the_best():
    view, _, _ = cluster(beat("p1", "prefill", load=5), beat("p2", "prefill", load=1))
    candidates = Candidates(view, Margins())
    assert ids(candidates.prefill.candidates()) == ["p2"]
    view.observe(beat("p1", "prefill", load=0))
    assert ids(candidates.prefill.candidates()) == ["p1"]


def test_the_speed_a_heartbeat_measured_orders_idle_instances_before_their_load():
    view, _, _ = cluster(beat("p1", "prefill", speed=1.5), beat("p2", "prefill", load=3, speed=1.2))
    candidates = Candidates(view, Margins())
    assert ids(candidates.prefill.candidates()) == ["p2"]


def test_each_cost_model_and_source_of_speed_has_its_own_best():
    view, _, _ = cluster(beat("p1", "prefill", load=1), beat("p2", "prefill", load=2),
                         beat("p3", "prefill", load=1, cost=coefficients(prefill_per_token=0.002)),
                         beat("p4", "prefill", load=4, speed=0.9), beat("p5", "prefill", load=5, speed=0.9))  # fmt: skip
    candidates = Candidates(view, Margins())
    assert ids(candidates.prefill.candidates()) == ["p1", "p3", "p4"]


def test_a_booked_instance_is_looked_at_until_its_work_is_done():
    view, index, _ = cluster(beat("p1", "prefill"), beat("p2", "prefill"), beat("d1", "decode"), beat("d2", "decode"))
    scheduler = Admitter(build_policy("cache_aware"), view, index, config())
    assert (scheduler.admit(request("a")).prefill_id, scheduler.admit(request("b")).prefill_id) == ("p1", "p2")
    pruned = scheduler.candidates
    assert ids(pruned.prefill.busy()) == ["p1", "p2"]
    assert ids(pruned.decode.busy()) == ["d1", "d2"]
    scheduler.first_token("a")
    scheduler.finished("a")
    assert ids(pruned.prefill.busy()) == ["p2"]
    assert ids(pruned.prefill.candidates()) == ["p1", "p2"]
    assert ids(pruned.decode.candidates()) == ["d1", "d2"]


def test_instances_with_speeds_of_their_own_are_compared_by_speed_until_they_forget_it():
    view, _, clock = cluster(*(beat(f"d{i}", "decode") for i in range(1, 6)))
    margins = Margins(clock=clock)
    candidates = Candidates(view, margins)
    assert ids(candidates.decode.candidates()) == ["d1"]
    for _ in range(5):  # d3's steps take half what its model says, d4's 0.6 of it: both may now be fastest
        margins.observe_tbt("d3", observed=0.01, predicted=0.02)
        margins.observe_tbt("d4", observed=0.012, predicted=0.02)
    assert ids(candidates.decode.candidates()) == ["d1", "d3"]
    view.timeout = 1e9  # no heartbeat comes to file them again: only the clock changes
    clock.now = 200.0
    for _ in range(5):  # d4 slows down to 0.7
        margins.observe_tbt("d4", observed=0.014, predicted=0.02)
    assert ids(candidates.decode.candidates()) == ["d1", "d3"]
    clock.now = 301.0  # d3's samples are forgotten: it has the cluster's speed again, like d1 (which ranks before it)
    assert margins.own_decode_speed("d3") is None
    assert ids(candidates.decode.candidates()) == ["d1", "d4"]


def test_excluded_and_silent_instances_are_never_candidates():
    view, _, clock = cluster(beat("p1", "prefill"), beat("p2", "prefill"), beat("p3", "prefill"))
    candidates = Candidates(view, Margins())
    assert ids(candidates.prefill.candidates(skip={"p1"})) == ["p2"]
    clock.now = 2.0
    view.observe(beat("p3", "prefill"))
    clock.now = 4.0
    assert ids(view.alive(Role.PREFILL)) == ["p3"]
    assert ids(candidates.prefill.candidates()) == ["p3"]


def test_stale_entries_are_dropped_when_the_heaps_outgrow_the_instances():
    view, _, _ = cluster(beat("p1", "prefill"), beat("p2", "prefill"))
    candidates = Candidates(view, Margins())
    for load in range(200):  # every new load files p1 again
        view.observe(beat("p1", "prefill", load=load + 1))
        assert ids(candidates.prefill.candidates()) == ["p2"]
    assert candidates.prefill._entries <= 2 * 2 + 64 + 1


def test_the_router_picks_what_it_picks_among_every_instance():
    """A simulated cluster run twice, with and without pruning: every decision the same."""
    trace = hot_prefix(n=400, rate=40.0, prefixes=20, seed=3)
    for policy in ("cache_aware", "cache_aware+replication"):
        decisions = []
        for prune in (True, False):
            sim = Simulation(SimConfig(24, 12, policy, store_blocks=0, prefill_cache_blocks=400), trace)
            if not prune:
                sim.scheduler.candidates = None
            result = sim.run()
            decisions.append([(r.decision.prefill_id, r.decision.decode_id, r.decision.predicted_ttft_s,
                               r.decision.copy_from, r.decision.error_code) for r in result.requests])  # fmt: skip
        assert decisions[0] == decisions[1]
        assert len({d[0] for d in decisions[0]}) == 24  # busy enough to spread over every prefill instance


def test_random_clusters_route_alike_with_and_without_pruning():
    rng = random.Random(5)
    for trial in range(20):
        beats = [beat(f"p{i}", "prefill", load=rng.randint(0, 2), speed=rng.choice([0.0, 0.0, 1.0, 1.3]))
                 for i in range(12)]  # fmt: skip
        beats += [beat(f"d{i}", "decode", load=0) for i in range(6)]
        chosen = []
        for prune in (True, False):
            view, index, clock = cluster(*beats)
            for i in range(12):
                index.add(f"p{i}", "device", [bytes([b]) * 16 for b in range(random.Random(trial * 100 + i).randint(0, 9))])
            scheduler = Admitter(build_policy("cache_aware+replication"), view, index, config())
            if not prune:
                scheduler.candidates = None
            picks = []
            for k in range(30):
                clock.now += 0.05
                d = scheduler.admit(request(f"r{k}", tokens=170 + 16 * (k % 7)))
                picks.append((d.prefill_id, d.decode_id, d.copy_from))
                if k >= 3:
                    scheduler.first_token(f"r{k - 3}")
                if k >= 6:
                    scheduler.finished(f"r{k - 6}", 8)
            chosen.append(picks)
        assert chosen[0] == chosen[1]


def test_the_least_tbt_is_found_reading_only_the_batches_a_bound_does_not_rule_out():
    """`AdmitContext.least_tbt` picks what the least `decode_tbt` (then id) picks, on
    decode instances with batches, requests on their way and speeds of their own, and
    reads the exact TBT of few of them where most are idle."""
    rng = random.Random(11)
    for trial in range(30):
        beats = [beat(f"d{i}", "decode", batch_size=rng.choice([0, 0, 0, 1, 3, 8]),
                      context_tokens=rng.choice([0, 200, 4000]),
                      cost=coefficients(decode_per_context_token=rng.choice([0.0, 1e-6])))
                 for i in range(16)]  # fmt: skip
        beats.append(beat("p0", "prefill"))
        view, index, clock = cluster(*beats)
        scheduler = Admitter(build_policy("cache_aware"), view, index, config())
        for k in range(rng.randint(0, 6)):  # requests booked on some decode instances, some of them decoding
            scheduler.admit(request(f"b{k}", tokens=rng.choice([40, 900])))
            if rng.random() < 0.5:
                scheduler.first_token(f"b{k}")
        for i in range(16):
            for _ in range(rng.choice([0, 0, 6])):  # an instance with a speed of its own
                scheduler.margins.observe_tbt(f"d{i}", observed=rng.choice([0.3, 1.0, 4.0]), predicted=1.0)
        clock.now += 0.5
        ctx = scheduler.context(request("r", tokens=rng.choice([20, 500, 3000]), num_sequences=rng.choice([1, 2])))
        decodes = view.alive("decode")
        expected = min(decodes, key=lambda d: (ctx.decode_tbt(d), d.instance_id))
        assert ctx.least_tbt(decodes) is expected
    # a batch whose generated tokens its bound leaves out, beside a slow idle instance whose
    # bound (its TBT) is a little under that batch's TBT: the idle one is read and picked
    cost = coefficients(decode_per_context_token=1e-5)
    view, index, clock = cluster(beat("a", "decode", cost=cost), beat("b", "decode", cost=cost))
    scheduler = Admitter(build_policy("cache_aware"), view, index, config())
    view.get("a").decode.add("x", prompt_tokens=40, start=0.0, tokens=0, expected=100_000)
    view.get("a").decode.started("x", 0.0)
    for _ in range(5):
        scheduler.margins.observe_tbt("a", observed=1.0, predicted=1.0)
        scheduler.margins.observe_tbt("b", observed=1.25, predicted=1.0)
    clock.now = 2.5  # "a" has generated some 200 tokens since
    ctx = scheduler.context(request(tokens=20))
    a, b = view.get("a"), view.get("b")
    assert ctx.decode_tbt(b) < ctx.decode_tbt(a) and ctx.least_tbt([a, b]) is b
    # one cost model, one speed: the busy instance is never read beside an idle one
    idle = [beat(f"d{i}", "decode") for i in range(8)] + [beat("busy", "decode", batch_size=4)]
    view, index, _ = cluster(*idle)
    ctx = Admitter(build_policy("cache_aware"), view, index, config()).context(request())
    read = []
    exact = ctx.decode_tbt
    ctx.decode_tbt = lambda d: read.append(d.instance_id) or exact(d)
    assert ctx.least_tbt(view.alive("decode")).instance_id == "d0" and "busy" not in read
