from libs.protocol.slo import DEFAULT_TBT_S, DEFAULT_TTFT_S, SLO


def test_the_defaults_are_the_documented_targets():
    assert SLO() == SLO(ttft_s=DEFAULT_TTFT_S, tbt_s=DEFAULT_TBT_S) == SLO.from_ms(2000, 150)


def test_a_request_meets_both_targets_or_none():
    slo = SLO(ttft_s=1.0, tbt_s=0.1)
    assert slo.met(1.0, 0.1)
    assert not slo.met(1.01, 0.05)
    assert not slo.met(0.5, 0.11)
    assert not slo.met(None, 0.05)  # never measured: not met
    assert not slo.met(0.5, None)


def test_a_request_overrides_only_the_targets_it_gives():
    slo = SLO(ttft_s=2.0, tbt_s=0.15)
    assert slo.overridden(None, None) == slo
    assert slo.overridden(5.0, None) == SLO(5.0, 0.15)
    assert slo.overridden(None, 0.5) == SLO(2.0, 0.5)
