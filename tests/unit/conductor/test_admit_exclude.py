"""A re-admission names the instances its gateway saw die: the conductor never
routes to them, even while their heartbeats have not timed out here yet."""

from services.conductor.admission_policy import build_policy
from services.conductor.admitter import Admitter
from tests.unit.conductor.helpers import PROMPT, beat, cluster, config, request


def scheduler(*beats) -> Admitter:
    view, index, _ = cluster(*beats)
    index.add("p0", "device", PROMPT)  # p0 holds the whole prefix: cache-aware routing wants it
    return Admitter(build_policy("cache_aware"), view, index, config())


def test_excluded_instances_are_not_chosen_though_still_alive_in_the_view():
    beats = beat("p0", "prefill"), beat("p1", "prefill"), beat("d0", "decode"), beat("d1", "decode")
    first = scheduler(*beats).admit(request("r"))
    assert (first.prefill_id, first.decode_id) == ("p0", "d0")
    d = scheduler(*beats).admit(request("r-m1", exclude=["p0", "d0"]))
    assert (d.prefill_id, d.decode_id) == ("p1", "d1")
    assert d.cached_tokens == {}  # p0's cached prefix is not counted on for p1


def test_excluding_the_only_decode_instance_refuses_with_no_decode():
    s = scheduler(beat("p0", "prefill"), beat("d0", "decode"))
    d = s.admit(request("r-m1", exclude=["d0"]))
    assert not d.admitted and d.error_code == "no_decode"
