"""The capacity search against synthetic attainment(load) curves: which time
scales it probes, the bracket it ends with, and what the report says."""

import random

import pytest

from kvserve.replay.capacity import Probe, find_capacity, probe_beyond
from kvserve.replay.report import capacity_verdict, probes_table

UNIT_RPS = 2.0  # the synthetic trace window's offered rate at time scale 1


def curve(attainment):
    """A measure whose attainment is ``attainment(offered req/s)``; it records the scales asked."""
    asked = []

    def measure(scale: float, probe: int) -> Probe:
        assert probe == len(asked)  # probes are numbered in order: probe i replays with seed + i
        asked.append(scale)
        load = UNIT_RPS / scale
        met = attainment(load)
        return Probe(scale, load, met, met * load)

    return measure, asked


def linear(capacity_rps: float):
    """Monotone: 100% at no load, exactly 90% at ``capacity_rps``, falling beyond."""
    return lambda load: max(0.0, 1.0 - 0.1 * load / capacity_rps)


def test_brackets_by_halving_then_bisects_in_log_space():
    measure, asked = curve(linear(capacity_rps=5.0))  # 5 req/s = time scale 0.4
    result = find_capacity(measure, start_scale=1.0, max_probes=6)
    # 1 (2 req/s) and 0.5 (4 req/s) pass, 0.25 (8 req/s) fails; then sqrt(0.5 * 0.25), ...
    assert asked[:3] == [1.0, 0.5, 0.25]
    assert asked[3] == pytest.approx(0.5**1.5)  # 5.66 req/s: fails
    assert asked[4] == pytest.approx(0.5**1.25)  # 4.76 req/s: passes
    assert asked[5] == pytest.approx(0.5**1.375)  # 5.19 req/s: fails
    assert len(result.probes) == 6
    assert result.capacity_rps == pytest.approx(UNIT_RPS / 0.5**1.25)
    assert result.first_failure_above.offered_rps == pytest.approx(UNIT_RPS / 0.5**1.375)
    assert result.capacity_rps <= 5.0 < result.first_failure_above.offered_rps
    assert result.precision_rps == pytest.approx(2.0 * (2**1.375 - 2**1.25))


def test_brackets_by_doubling_when_the_first_load_fails():
    measure, asked = curve(linear(capacity_rps=0.3))  # 0.3 req/s = time scale 6.67
    result = find_capacity(measure, start_scale=1.0, max_probes=5, max_scale=8.0)
    assert asked[:4] == [1.0, 2.0, 4.0, 8.0]  # 8 passes: 0.25 req/s
    assert asked[4] == pytest.approx(32**0.5)
    assert result.capacity_rps == pytest.approx(0.25)  # sqrt(32) = 0.354 req/s failed
    assert result.first_failure_above.time_scale == pytest.approx(32**0.5)


@pytest.mark.parametrize("seed", range(20))
def test_noise_never_breaks_the_bracket_or_the_budget(seed):
    rng = random.Random(seed)
    true_capacity = rng.uniform(0.5, 20.0)
    truth = linear(true_capacity)
    measure, asked = curve(lambda load: min(1.0, max(0.0, truth(load) + rng.uniform(-0.02, 0.02))))
    result = find_capacity(measure, start_scale=rng.choice([0.25, 1.0, 4.0]), max_probes=7, max_scale=64.0)
    assert len(asked) == 7
    best, above = result.best, result.first_failure_above
    assert best is not None and above is not None
    assert best.slo_attainment >= 0.9 > above.slo_attainment
    assert best.offered_rps < above.offered_rps
    # noise of 0.02 moves the 90% point of a line falling 0.1 per capacity by at most 20%
    assert best.offered_rps <= 1.2 * true_capacity and above.offered_rps >= 0.8 * true_capacity
    assert result.precision_rps == pytest.approx(above.offered_rps - best.offered_rps)


def test_a_system_that_never_reaches_the_target_has_no_capacity():
    measure, asked = curve(lambda load: 0.6 if load < 0.1 else 0.4)
    result = find_capacity(measure, start_scale=1.0, max_probes=8, max_scale=32.0)
    assert asked == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]  # lighter and lighter, to the lightest allowed
    assert result.best is None and result.capacity_rps is None and result.precision_rps is None
    peak = result.peak_goodput
    assert peak.time_scale == 1.0 and peak.goodput_rps == pytest.approx(0.4 * 2.0)
    verdict = capacity_verdict(result)
    assert verdict.startswith("no capacity: no load tried reached 90% SLO attainment")
    assert "the lightest, 0.062 req/s, attained 60.0%" in verdict
    assert "peak goodput 0.800 req/s at 2.000 req/s offered" in verdict


def test_doubling_stops_at_the_largest_time_scale_and_spends_no_more_probes():
    measure, asked = curve(lambda load: 0.5)
    result = find_capacity(measure, start_scale=3.0, max_probes=6)  # default: up to 8 x 3
    assert asked == [3.0, 6.0, 12.0, 24.0]
    assert result.capacity_rps is None
    measure, asked = curve(lambda load: 0.5)
    find_capacity(measure, start_scale=3.0, max_probes=6, max_scale=10.0)
    assert asked == [3.0, 6.0, 10.0]  # clamped, then stopped


def test_a_system_that_always_reaches_the_target_gives_a_lower_bound():
    measure, asked = curve(lambda load: 1.0)
    result = find_capacity(measure, start_scale=2.0, max_probes=4)
    assert asked == [2.0, 1.0, 0.5, 0.25]
    assert result.capacity_rps == pytest.approx(8.0)
    assert result.first_failure_above is None and result.precision_rps is None
    assert capacity_verdict(result).startswith("capacity at least 8.000 req/s: every load tried reached 90%")


def test_the_verdict_and_table_give_capacity_bracket_and_every_probe():
    measure, _ = curve(linear(capacity_rps=5.0))
    result = find_capacity(measure, start_scale=1.0, max_probes=3, target=0.9, label="x")
    assert capacity_verdict(result).startswith(
        "capacity 4.000 req/s at 90% SLO attainment (time scale 0.5, 92.0% attained); "
        "8.000 req/s attained 84.0%, so the capacity is known to within 4.000 req/s"
    )
    rows = probes_table(result).splitlines()[2:]
    assert rows == [
        "| 0 | 1 | 2.000 | 96.0% | 1.920 | yes |",
        "| 1 | 0.5 | 4.000 | 92.0% | 3.680 | yes |",
        "| 2 | 0.25 | 8.000 | 84.0% | 6.720 | no |",
    ]


def test_a_lower_target_finds_a_higher_capacity():
    measure, _ = curve(linear(capacity_rps=5.0))  # 50% at 25 req/s
    result = find_capacity(measure, start_scale=1.0, max_probes=6, target=0.5)
    assert 20.0 < result.capacity_rps <= 25.0 < result.first_failure_above.offered_rps


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"start_scale": 0.0}, "start time scale must be a positive number"),
        ({"start_scale": float("inf")}, "start time scale must be a positive number"),
        ({"max_probes": 0}, "at least one probe"),
        ({"start_scale": 2.0, "max_scale": 1.0}, "largest time scale must be at least the start scale 2, got 1.0"),
        ({"target": 0.0}, r"target attainment must be in \(0, 1\]"),
        ({"target": 1.5}, r"target attainment must be in \(0, 1\]"),
    ],
)
def test_bad_search_settings_are_refused_before_any_probe(kwargs, message):
    measure, asked = curve(lambda load: 1.0)
    with pytest.raises(ValueError, match=message):
        find_capacity(measure, **kwargs)
    assert asked == []


def test_probes_beyond_the_capacity_are_at_its_multiples_with_fixed_seeds_and_never_move_it():
    measure, _ = curve(linear(3.0))
    found = find_capacity(measure, start_scale=1.0, max_probes=5)
    asked = []

    def beyond(scale: float, probe: int) -> Probe:
        asked.append((scale, probe))
        load = UNIT_RPS / scale
        return Probe(scale, load, 0.5, 0.5 * load)  # past capacity: half met, more goodput all the same

    more = probe_beyond(found, beyond, [2, 4], first_probe=5)
    assert asked == [(pytest.approx(found.best.time_scale / 2), 5), (pytest.approx(found.best.time_scale / 4), 6)]
    assert (more.best, more.capacity_rps, more.probes) == (found.best, found.capacity_rps, found.probes)
    assert more.peak_goodput == found.peak_goodput  # the search's
    assert more.peak_goodput_any is more.beyond[1]  # 0.5 x 4 x capacity
    none = find_capacity(curve(lambda load: 0.0)[0], start_scale=1.0, max_probes=2)
    assert probe_beyond(none, beyond, [2], first_probe=2) is none  # no capacity: nothing to multiply
