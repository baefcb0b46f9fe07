"""The cost model: its formulas, the non-negative fit, and a calibration run on a real engine."""

import pytest

from libs.engine.cost_model import CostModel, calibrate, decode_features, fit_nonnegative, prefill_features
from libs.engine.model.engine import EngineConfig
from libs.engine.model.loader import build_engine
from tests.unit.conductor.helpers import coefficients


def test_the_formulas():
    model = CostModel(coefficients(prefill_base=0.01, prefill_per_token_context=1e-6, decode_per_context_token=1e-5,
                                   transfer_per_block=0.002, load_per_block={"disk": 0.05}))  # fmt: skip
    assert model.prefill_time(100, 200) == pytest.approx(0.01 + 100 * (0.001 + 1e-6 * (200 + 50)))
    assert model.prefill_time(0, 200) == 0.0
    assert model.decode_step_time(4, 1000) == pytest.approx(0.01 + 0.004 + 0.01)
    assert model.transfer_time(3) == pytest.approx(0.006)
    assert model.load_time_per_block("disk") == 0.05  # measured by the store
    assert model.load_time_per_block("dram") == 0.002  # a shared-memory copy
    assert model.load_time_per_block("device") == 0.0


def test_the_fit_recovers_exact_coefficients():
    truth = (0.02, 0.001, 3e-7)
    points = [(32, 0), (128, 0), (256, 0), (64, 448), (128, 256)]
    seconds = [sum(c * f for c, f in zip(truth, prefill_features(n, ctx))) for n, ctx in points]
    assert fit_nonnegative([prefill_features(n, ctx) for n, ctx in points], seconds) == pytest.approx(truth)


def test_a_coefficient_the_noise_drives_negative_is_pinned_to_zero():
    points = [(1, 64), (8, 64), (4, 448), (8, 320)]
    seconds = [0.03 + 0.004 * b - 1e-7 * b * ctx for b, ctx in points]  # a "negative" context cost
    d, e, f = fit_nonnegative([decode_features(b, b * ctx) for b, ctx in points], seconds)
    assert f == 0.0 and d > 0 and e > 0


def test_calibration_on_an_engine_fits_positive_costs_and_leaves_the_pool_as_it_was(tiny_model):
    engine = build_engine(tiny_model, EngineConfig(block_size=16, num_blocks=96))
    pool = engine.cache.block_pool
    c = calibrate(engine, budget_s=30.0)
    assert c.block_size == 16
    model = CostModel(c)  # timings are noisy on a shared machine: only the shape of the fit is certain
    assert min(c.prefill_base, c.prefill_per_token, c.prefill_per_token_context) >= 0
    assert model.prefill_time(256) >= model.prefill_time(32) > 0
    assert model.decode_step_time(8, 8 * 64) > 0 and c.transfer_per_block > 0
    assert engine.cache.block_pool is pool  # the real block manager is back
    assert (pool.num_free_blocks, pool.num_cached_blocks) == (96, 0)  # nothing held, nothing findable


def test_calibration_loads_the_native_prefill_kernel_before_it_times_anything(tmp_path, monkeypatch):
    """Its first use compiles it (where no cache has it): that must not be a timed point. The
    warm-up's short prefill loads it (paged_attention asks for it before looking at spans)."""
    from libs.engine import cost_model
    from libs.engine.model import attention
    from libs.engine.model.loader import load_model
    from tests.conftest import make_tiny_checkpoint

    folder = make_tiny_checkpoint(tmp_path / "tiny64", hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    loaded = load_model(str(folder), dtype="bfloat16", quantization="none", progress=False)  # the kernel's dtype
    attention._load_prefill_kernel.cache_clear()
    loaded_when_timing = []
    timed = cost_model._timed
    monkeypatch.setattr(cost_model, "_timed", lambda *a: loaded_when_timing.append(
        attention._load_prefill_kernel.cache_info().currsize) or timed(*a))  # fmt: skip
    calibrate(build_engine(loaded, EngineConfig(block_size=16, num_blocks=96)), budget_s=30.0)
    assert loaded_when_timing[0] == 1
