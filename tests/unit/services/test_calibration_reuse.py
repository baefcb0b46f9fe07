"""A restarted worker reuses its previous run's calibration when its engine has the same shape."""

import os

import msgspec
import pytest
import torch

from libs.engine import cost_model
from libs.engine.model.engine import EngineConfig
from libs.engine.model.loader import build_engine


@pytest.fixture
def engine(tiny_model):
    return build_engine(tiny_model, EngineConfig(num_blocks=64))


def test_a_saved_calibration_of_the_same_engine_is_reused_and_another_is_measured_over(engine, tmp_path, monkeypatch):
    saved = tmp_path / "prefill-0.calibration.json"
    measured = []
    real = cost_model.calibrate
    monkeypatch.setattr(cost_model, "calibrate", lambda e: measured.append(e) or real(e))

    first = cost_model.calibrate_once(engine, str(saved))
    assert len(measured) == 1 and saved.is_file()
    assert cost_model.calibrate_once(engine, str(saved)) == first  # the restart: nothing timed
    assert len(measured) == 1

    other = msgspec.json.decode(saved.read_bytes())
    other["engine"] = "another shape"
    saved.write_bytes(msgspec.json.encode(other))
    cost_model.calibrate_once(engine, str(saved))  # a different engine: measured again, file rewritten
    assert len(measured) == 2
    assert msgspec.json.decode(saved.read_bytes())["engine"] != "another shape"

    saved.write_text("not json")
    cost_model.calibrate_once(engine, str(saved))
    assert len(measured) == 3

    cost_model.calibrate_once(engine, None)  # no file: always measured
    assert len(measured) == 4


def test_a_saved_calibration_is_measured_over_on_another_core_share(engine, tmp_path, monkeypatch):
    saved = tmp_path / "decode-0.calibration.json"
    measured = []
    real = cost_model.calibrate
    monkeypatch.setattr(cost_model, "calibrate", lambda e: measured.append(e) or real(e))
    cost_model.calibrate_once(engine, str(saved))
    threads, cores = torch.get_num_threads(), os.sched_getaffinity(0)
    try:
        torch.set_num_threads(threads + 1)  # more threads: another share
        cost_model.calibrate_once(engine, str(saved))
        assert len(measured) == 2
        torch.set_num_threads(threads)
        os.sched_setaffinity(0, {min(cores)})  # the same threads on fewer cores: another share too
        cost_model.calibrate_once(engine, str(saved))
        assert len(measured) == 3
        assert f"/cores{min(cores)}" in msgspec.json.decode(saved.read_bytes())["engine"]
    finally:
        torch.set_num_threads(threads)
        os.sched_setaffinity(0, cores)
