"""Effective request capacity, Mooncake's headline figure: the highest offered
load at which a target share (0.9 by default) of the requests sent meets both
SLOs. Rejected and failed requests count as not met.

The search knows nothing about HTTP or traces: it asks a ``measure(time_scale,
probe)`` callable for one run's attainment and goodput at a time scale (smaller
is more load). It brackets the capacity by halving the time scale while probes
pass or doubling it while they fail (up to ``max_scale``: a lighter probe is a
longer one, and a system that fails there has no capacity), then bisects the
bracket in log space until ``max_probes`` runs are spent. The capacity is the offered rate of the heaviest
passing probe; its precision is the width, in req/s, of the final bracket.
``probe_beyond`` then measures loads at multiples of the capacity: what admission
does past it (attainment of the requests it admits, refusals by prompt size).
"""

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from kvserve.replay.metrics import Summary


@dataclass(frozen=True)
class Probe:
    """One run of the search: its load and what the SLOs made of it."""

    time_scale: float
    offered_rps: float
    slo_attainment: float  # good / sent
    goodput_rps: float  # good / second
    summary: Summary | None = None  # the replay behind it, when it was a real one


Measure = Callable[[float, int], Probe]  # (time scale, probe number from 0) -> its result


@dataclass(frozen=True)
class Capacity:
    """The probes of one search, in the order they ran, and what they show."""

    label: str
    target: float
    probes: tuple[Probe, ...]
    beyond: tuple[Probe, ...] = ()  # after the search, at multiples of the capacity (`probe_beyond`)

    def passes(self, probe: Probe) -> bool:
        return probe.slo_attainment >= self.target

    @property
    def best(self) -> Probe | None:
        """The heaviest probe that met the target; None when none did."""
        return max((p for p in self.probes if self.passes(p)), key=lambda p: p.offered_rps, default=None)

    @property
    def capacity_rps(self) -> float | None:
        """None means no capacity: no load tried met the target."""
        best = self.best
        return best.offered_rps if best else None

    @property
    def first_failure_above(self) -> Probe | None:
        """The lightest failing probe heavier than the best passing one: the bracket's
        other end. None when there is no capacity or every heavier load passed too."""
        best = self.best
        if best is None:
            return None
        heavier = [p for p in self.probes if not self.passes(p) and p.offered_rps > best.offered_rps]
        return min(heavier, key=lambda p: p.offered_rps, default=None)

    @property
    def precision_rps(self) -> float | None:
        """The final bracket's width; None when the capacity is not bracketed."""
        best, above = self.best, self.first_failure_above
        return above.offered_rps - best.offered_rps if best and above else None

    @property
    def peak_goodput(self) -> Probe:
        """The search's probe with the most goodput."""
        return max(self.probes, key=lambda p: p.goodput_rps)

    @property
    def peak_goodput_any(self) -> Probe:
        """The probe with the most goodput at any load tried, beyond the capacity included."""
        return max((*self.probes, *self.beyond), key=lambda p: p.goodput_rps)


MAX_SCALE_FACTOR = 8.0  # the default lightest load: the start scale times this


def validate(*, start_scale: float, max_probes: int, target: float, max_scale: float | None = None) -> None:
    if not (start_scale > 0 and math.isfinite(start_scale)):
        raise ValueError(f"the start time scale must be a positive number, got {start_scale}")
    if max_scale is not None and not (math.isfinite(max_scale) and max_scale >= start_scale):
        raise ValueError(f"the largest time scale must be at least the start scale {start_scale:g}, got {max_scale}")
    if max_probes < 1:
        raise ValueError(f"the search needs at least one probe, got {max_probes}")
    if not 0 < target <= 1:
        raise ValueError(f"the target attainment must be in (0, 1], got {target}")


def find_capacity(
    measure: Measure,
    *,
    start_scale: float = 1.0,
    max_probes: int = 6,
    target: float = 0.9,
    max_scale: float | None = None,
    label: str = "",
) -> Capacity:
    """Run at most ``max_probes`` measurements and return them all. ``max_scale``
    (default ``MAX_SCALE_FACTOR`` x ``start_scale``) is the lightest load probed."""
    validate(start_scale=start_scale, max_probes=max_probes, target=target, max_scale=max_scale)
    max_scale = max_scale if max_scale is not None else start_scale * MAX_SCALE_FACTOR
    probes: list[Probe] = []
    passing_scale: float | None = None  # the smallest scale (heaviest load) that passed
    failing_scale: float | None = None  # the largest scale below it (lightest load) that failed
    scale = start_scale
    while len(probes) < max_probes:
        if passing_scale is not None and failing_scale is not None:
            scale = math.sqrt(passing_scale * failing_scale)  # bisect in log space
        probe = measure(scale, len(probes))
        probes.append(probe)
        passed = probe.slo_attainment >= target
        if passed:
            passing_scale = scale
        else:
            failing_scale = scale
        if passing_scale is None and scale >= max_scale:
            break  # failed at the lightest load allowed: no capacity
        if passing_scale is None or failing_scale is None:
            scale = scale / 2 if passed else min(scale * 2, max_scale)
    return Capacity(label, target, tuple(probes))


def probe_beyond(capacity: Capacity, measure: Measure, factors: Sequence[float], first_probe: int) -> Capacity:
    """``capacity`` with a probe at each of ``factors`` times its capacity (time scale
    divided by the factor), numbered from ``first_probe`` (so every configuration's
    probe at a factor uses the same prompt seed); unchanged without a capacity. These
    loads test what admission does past the capacity; they never move it."""
    best = capacity.best
    if best is None or not factors:
        return capacity
    beyond = tuple(measure(best.time_scale / f, first_probe + i) for i, f in enumerate(factors))
    return replace(capacity, beyond=capacity.beyond + beyond)
