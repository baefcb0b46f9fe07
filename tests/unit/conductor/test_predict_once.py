"""One decision computes each instance's prediction once: the router, the affinity
rule, the admission rule and the decision log all read the same numbers."""

from collections import Counter

import pytest

from services.conductor.admission_policy import build_policy
from services.conductor.admitter import Admitter
from services.conductor.explain import DecisionLog
from tests.unit.conductor.helpers import PROMPT, beat, cluster, config, request


def counted(s: Admitter, calls: Counter) -> None:
    """Count, per instance, the looks at its prefill queue (a prefill instance) or its batch (a decode instance)."""
    for instance_id in ("p0", "p1", "d0", "d1"):
        instance = s.view.get(instance_id)
        load, name = (instance.prefill, "wait") if instance.role == "prefill" else (instance.decode, "current")
        real = getattr(load, name)

        def look(*args, _real=real, _id=instance_id, **kwargs):
            calls[_id] += 1
            return _real(*args, **kwargs)

        setattr(load, name, look)


@pytest.mark.parametrize("policy", ["cache_aware+predictive_rejection", "cache_aware+early_rejection",
                                    "cache_aware+replication+predictive_rejection", "least_loaded+local_prefill"])
def test_each_instance_is_predicted_once_per_decision(policy):
    beats = [beat(i, "prefill") for i in ("p0", "p1")] + [beat(i, "decode") for i in ("d0", "d1")]
    view, index, clock = cluster(*beats)
    s = Admitter(build_policy(policy), view, index, config())
    log = DecisionLog(policy)
    log.view("c0", index, config().slo, 1, 1)  # the console is watching: every candidate is explained
    s.explain = log.record
    index.add("p0", "device", PROMPT[:4])
    calls: Counter = Counter()
    counted(s, calls)
    for i in range(4):
        calls.clear()
        decision = s.admit(request(f"r{i}", session_id="chat"))
        assert decision.admitted
        assert calls and max(calls.values()) == 1, dict(calls)
    assert len(log.decisions(10)[-1].candidates) == 4
