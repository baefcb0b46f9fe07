"""bench/replay.py's options: `--max-input 0` is no cap; `--baseline PATH` runs the
checkout at PATH's own bench/replay.py (the command is checked, nothing is run)
and reads its runs back as kvserve-baseline; the machine's prefill speed is measured
for the report."""

import sys
from pathlib import Path

import pytest

from bench import baseline
from bench.replay import chosen, configs, machine_note, parser
from kvserve.replay.records import RequestRecord, Run

TRACE = ["--trace", "/traces/t.jsonl"]


def test_max_input_0_is_no_cap_and_the_default_stays_1024():
    assert parser().parse_args(["--max-input", "0"]).max_input is None
    assert parser().parse_args(["--max-input", "2048"]).max_input == 2048
    assert parser().parse_args([]).max_input == 1024


def test_the_baseline_runs_its_own_replay_on_kvserve_default_with_the_same_capacity_search(tmp_path):
    args = parser().parse_args([
        *TRACE, "--baseline", str(tmp_path / "old"), "--start", "6000", "--requests", "120", "--warm-history",
        "--block-tokens", "8", "--max-input", "0", "--max-output", "16", "--seed", "3", "--slo-ttft-ms", "1500",
        "--find-capacity", "--start-scale", "4", "--max-probes", "5", "--max-scale", "16", "--dtype", "bfloat16",
    ])  # fmt: skip
    out = tmp_path / "out" / "kvserve-baseline"
    assert baseline.command(args, out) == [
        sys.executable, str(tmp_path / "old" / "bench" / "replay.py"), "--configs", "kvserve-default",
        "--trace", "/traces/t.jsonl", "--start", "6000", "--requests", "120", "--block-tokens", "8",
        "--max-input", "100000", "--max-output", "16", "--slo-ttft-ms", "1500.0", "--slo-tbt-ms", "150.0",
        "--seed", "3", "--dtype", "bfloat16", "--request-timeout", "900.0", "--warm-history",
        "--find-capacity", "--target-attainment", "0.9", "--max-probes", "5", "--start-scale", "4.0",
        "--max-scale", "16.0", "--capacity-report", str(out / "capacity.md"), "--out", str(out),
    ]  # fmt: skip
    assert baseline.environment(args)["PYTHONPATH"] == str(tmp_path / "old")


def test_the_baselines_probes_beyond_capacity_are_a_sweep_seeded_after_its_search(tmp_path):
    args = parser().parse_args([*TRACE, "--baseline", str(tmp_path / "old"), "--seed", "3", "--find-capacity",
                                "--max-probes", "5", "--beyond", "2", "4"])  # fmt: skip
    cmd = baseline.command(args, tmp_path / "beyond", [0.5, 0.25])
    assert cmd[cmd.index("--seed") + 1] == "8"  # probe 5 on: the seed every configuration used there
    assert cmd[-5:] == ["--time-scales", "0.5", "0.25", "--out", str(tmp_path / "beyond")]
    assert "--find-capacity" not in cmd


def test_a_baseline_sweep_passes_the_time_scales_a_cap_and_bursts():
    args = parser().parse_args([*TRACE, "--baseline", "/old", "--time-scales", "4", "2", "--max-input", "1024",
                                "--no-spread", "--worker-threads", "2"])  # fmt: skip
    cmd = baseline.command(args, Path("/runs/kvserve-baseline"))
    assert cmd[cmd.index("--max-input") + 1] == "1024"
    assert cmd[cmd.index("--request-timeout") + 2:] == [
        "--no-spread", "--worker-threads", "2", "--time-scales", "4.0", "2.0", "--out", "/runs/kvserve-baseline",
    ]  # fmt: skip
    assert "--find-capacity" not in cmd and "--warm-history" not in cmd


@pytest.mark.parametrize(
    "argv, error",
    [
        (["--configs", "kvserve-baseline"], "kvserve-baseline needs --baseline PATH"),
        (["--baseline", "NOPE"], "--baseline NOPE: no bench/replay.py there (give a kvserve checkout)"),
        (["--baseline", "CHECKOUT", "--configs", "kvserve-default"],
         "--baseline runs as kvserve-baseline: name it in --configs too"),
        (["--baseline", "CHECKOUT", "--configs", "kvserve-baseline", "kvserve-default"], None),
        (["--baseline", "CHECKOUT"], None),
        ([], None),
    ],
)  # fmt: skip
def test_baseline_and_configs_must_agree(tmp_path, monkeypatch, argv, error):
    (tmp_path / "CHECKOUT" / "bench").mkdir(parents=True)
    (tmp_path / "CHECKOUT" / "bench" / "replay.py").write_text("")
    monkeypatch.chdir(tmp_path)
    assert baseline.usage_error(parser().parse_args(argv)) == error


def test_configurations_run_in_the_order_given_with_the_baseline_after_kvserve_default(tmp_path):
    every = configs(None, tmp_path)
    assert [c.name for c in every][:3] == ["kvserve-default", "kvserve-baseline", "kvserve-no-shared-prefill"]
    assert [c.kind for c in every][1] == "baseline"
    picked = chosen(every, ["kvserve-default", "llama.cpp", "kvserve-baseline"])
    assert [c.name for c in picked] == ["kvserve-default", "llama.cpp", "kvserve-baseline"]
    assert "kvserve-baseline" not in [c.name for c in configs(None)]


def saved(out: Path, scale: float, seed: int, started_at: float | None, attained: bool) -> None:
    settings = {"seed": seed, "block_tokens": 16} | ({} if started_at is None else {"started_at": started_at})
    records = [RequestRecord(i, float(i), 64, 2, status="ok" if attained else "rejected", start_s=float(i),
                             ttft_s=0.1 if attained else None, e2e_s=0.15 if attained else None,
                             output_tokens=2 if attained else 0, ended_s=i + 0.2) for i in range(3)]  # fmt: skip
    Run("kvserve-default", "http://x", scale, 4.0, records, settings).save(out / f"kvserve-default-x{scale:g}.json")


def test_the_baselines_runs_are_read_back_in_the_order_they_ran_and_relabelled(tmp_path):
    saved(tmp_path, 2.0, seed=11, started_at=100.0, attained=False)
    saved(tmp_path, 4.0, seed=10, started_at=100.0, attained=True)
    saved(tmp_path, 8.0, seed=12, started_at=50.0, attained=True)  # from an earlier invocation
    runs = baseline.load_runs(tmp_path, since=90.0)
    assert [(r.label, r.time_scale) for r in runs] == [("kvserve-baseline", 4.0), ("kvserve-baseline", 2.0)]
    assert len(baseline.load_runs(tmp_path)) == 3


def test_the_baselines_probes_make_its_capacity(tmp_path):
    from kvserve.replay.metrics import summarize
    from libs.protocol.slo import SLO

    saved(tmp_path, 4.0, seed=10, started_at=None, attained=True)
    saved(tmp_path, 2.0, seed=11, started_at=None, attained=False)
    summaries = [summarize(r, SLO()) for r in baseline.load_runs(tmp_path)]
    found = baseline.capacity(summaries, 0.9, unit_rps=1.0)
    assert found.label == "kvserve-baseline"
    assert [(p.time_scale, p.offered_rps, p.slo_attainment) for p in found.probes] == [(4.0, 1.0, 1.0), (2.0, 1.0, 0.0)]
    assert found.capacity_rps == 1.0 and found.probes[0].summary is summaries[0]


def test_the_workload_options_are_kvserve_benchs_own_with_this_scripts_defaults():
    from kvserve.cli.main import build_parser

    shared = ["--trace", "/t.jsonl", "--start", "7", "--warm-history", "--block-tokens", "8", "--max-input", "0",
              "--max-output", "4", "--slo-ttft-ms", "900", "--slo-tbt-ms", "90", "--seed", "5", "--find-capacity",
              "--target-attainment", "0.8", "--max-probes", "3", "--start-scale", "2", "--max-scale", "8",
              "--out", "/o"]  # fmt: skip
    ours = vars(parser().parse_args(shared))
    theirs = vars(build_parser().parse_args(["bench", "--base-url", "http://127.0.0.1:1", *shared]))
    names = ("trace", "start", "warm_history", "block_tokens", "max_input", "max_output", "slo_ttft_ms", "slo_tbt_ms",
             "seed", "find_capacity", "target_attainment", "max_probes", "start_scale", "max_scale", "out")  # fmt: skip
    assert {n: ours[n] for n in names} == {n: theirs[n] for n in names}
    defaults = parser().parse_args([])
    assert (defaults.max_input, defaults.max_output, defaults.start_scale, defaults.max_probes) == (1024, 16, 4.0, 6)
    with pytest.raises(SystemExit):
        parser().parse_args(["--max-output", "0"])  # kvserve bench's check: at least 1


def test_the_report_names_the_cpu_and_its_measured_prefill_speed():
    note = machine_note(reps=1)  # a real bench/engine.py --prefill-speed: the default model prefills 2,048 tokens
    assert note.startswith("CPU ") and "not measured" not in note
    speed = float(note.split("): ")[1].split(" tokens/s")[0].replace(",", ""))
    assert speed > 0 and "at 2,048 tokens (int4-eager, " in note
