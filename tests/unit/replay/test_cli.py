"""`kvserve bench` end to end against the fake server: a two-load sweep of a
tiny trace leaves every request in JSON, a summary and the plots."""

import json

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from kvserve.cli.main import main
from tests.unit.replay.fake_openai import FakeServer, Script, serving_in_thread

TRACE = [
    {"timestamp": 0, "input_length": 1100, "output_length": 3, "hash_ids": [0, 1, 2]},
    {"timestamp": 100, "input_length": 1024, "output_length": 50, "hash_ids": [0, 1]},
    {"timestamp": 200, "input_length": 300, "output_length": 2, "hash_ids": [7]},
]


def tiny_tokenizer(path) -> None:
    vocab = {"<s>": 0, "</s>": 1} | {f"w{i}": i for i in range(2, 40)}
    tok = Tokenizer(WordLevel(vocab, unk_token="w2"))
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(path))


def bench(tmp_path, server: FakeServer, *args: str) -> int:
    """`kvserve bench` on TRACE, with the tiny tokenizer, against ``server``, labelled
    "fake", its results in ``tmp_path / "out"``."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in TRACE) + "\n")
    tiny_tokenizer(tmp_path / "tokenizer.json")
    with serving_in_thread(server) as url:
        return main([
            "bench", "--trace", str(trace), "--base-url", url, "--tokenizer", str(tmp_path / "tokenizer.json"),
            "--label", "fake", "--out", str(tmp_path / "out"), "--no-progress", *args,
        ])  # fmt: skip


def test_bench_sweep_writes_every_request_a_summary_and_plots(tmp_path):
    server = FakeServer({}, default=Script(ttft_s=0.01, itl_s=(0.01,), cached_tokens=8))
    out = tmp_path / "out"
    code = bench(tmp_path, server, "--block-tokens", "8", "--max-output", "4", "--time-scale", "1", "0.5",
                 "--seed", "10")  # fmt: skip
    assert code == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "fake-x0.5.json", "fake-x1.json", "goodput_vs_load.png", "summary.md", "ttft_cdf.png",
    ]  # fmt: skip
    run = json.loads((out / "fake-x1.json").read_text())
    assert [r["index"] for r in run["requests"]] == [0, 1, 2]
    assert [r["input_tokens"] for r in run["requests"]] == [17, 16, 5]  # 1100 * 8 / 512 rounded, ...
    assert [r["max_tokens"] for r in run["requests"]] == [3, 4, 2]
    assert [r["cached_blocks_expected"] for r in run["requests"]] == [0, 2, 0]
    assert all(r["status"] == "ok" and r["cached_tokens"] == 8 for r in run["requests"])
    assert run["settings"]["seed"] == 10 and json.loads((out / "fake-x0.5.json").read_text())["settings"]["seed"] == 11
    assert run["summary"]["requests"] == 3 and run["summary"]["good"] == 3
    # both runs sent the same structure with different tokens; special tokens never
    prompts = [b["prompt"] for b in server.bodies]
    assert len(prompts) == 6 and all(0 not in p and 1 not in p for p in prompts)
    first, second = prompts[:3], prompts[3:]  # the runs go one after the other
    for sent in (first, second):
        by_length = {len(p): p for p in sent}
        assert by_length[17][:16] == by_length[16]  # hash ids 0, 1 shared
    assert {len(p): p for p in first}[16] != {len(p): p for p in second}[16]  # seed 10 vs 11
    summary = (out / "summary.md").read_text()
    assert "| fake | 1 |" in summary and "| fake | 0.5 |" in summary
    assert "Goodput at 90% SLO attainment" in summary
    # every prompt is under 128 tokens: that band holds the run, the others are empty
    assert "| fake ×1 | <128 | 3 | 3 | 0 | 0 | 0 | 3 | 100.0% | 100.0% |" in summary
    assert "| fake ×0.5 | >=1024 | 0 | 0 | 0 | 0 | 0 | 0 | – | – | – / – |" in summary
    assert run["summary"]["rejected_while_idle"] == 0 and run["summary"]["bands"][0]["requests"] == 3


def test_find_capacity_probes_heavier_loads_with_fresh_seeds_and_writes_its_report(tmp_path):
    server = FakeServer({}, default=Script(ttft_s=0.0, itl_s=(0.0,)))  # every request meets the SLOs
    out = tmp_path / "out"
    code = bench(tmp_path, server, "--block-tokens", "8", "--max-output", "2", "--find-capacity", "--start-scale", "2",
                 "--max-probes", "2", "--seed", "10")  # fmt: skip
    assert code == 0
    assert sorted(p.name for p in out.iterdir()) == ["capacity.md", "capacity.png", "fake-x1.json", "fake-x2.json"]
    # every probe passed, so the second halved the time scale, with the next seed
    first, second = (json.loads((out / name).read_text()) for name in ("fake-x2.json", "fake-x1.json"))
    assert (first["settings"]["seed"], second["settings"]["seed"]) == (10, 11)
    assert (first["summary"]["offered_rps"], second["summary"]["offered_rps"]) == (5.0, 10.0)  # 2 gaps over 0.4 s, 0.2 s
    prompts = [b["prompt"] for b in server.bodies]
    assert len(prompts) == 6 and not set(map(tuple, prompts[:3])) & set(map(tuple, prompts[3:]))
    report = (out / "capacity.md").read_text()
    assert "**capacity at least 10.000 req/s: every load tried reached 90% SLO attainment" in report
    assert "| 0 | 2 | 5.000 | 100.0% |" in report and "| 1 | 1 | 10.000 | 100.0% |" in report
    assert "| peak goodput = capacity (×1, 10.000 req/s) | <128 | 3 | 3 | 0 | 0 | 0 | 3 | 100.0% | 100.0% |" in report


def test_find_capacity_refuses_a_window_whose_requests_arrive_at_once(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    trace.write_text(json.dumps(TRACE[0]) + "\n")
    tiny_tokenizer(tmp_path / "tokenizer.json")
    code = main([
        "bench", "--trace", str(trace), "--base-url", "http://127.0.0.1:9", "--tokenizer", str(tmp_path / "tokenizer.json"),
        "--find-capacity", "--out", str(tmp_path / "out"), "--no-progress",
    ])  # fmt: skip
    assert code == 1
    assert "this trace window's arrivals span no time (1 request): a load search needs" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before any probe


def test_warm_history_sends_what_the_window_shares_with_the_trace_before_it_then_the_run(tmp_path):
    server = FakeServer({}, default=Script())
    out = tmp_path / "out"
    code = bench(tmp_path, server, "--block-tokens", "8", "--start", "1", "--warm-history", "--time-scale", "1",
                 "--seed", "10")  # fmt: skip
    assert code == 0
    warming, *sent = server.bodies
    assert warming["max_tokens"] == 1 and len(sent) == 2
    run = json.loads((out / "fake-x1.json").read_text())
    by_index = {r["index"]: r for r in run["requests"]}
    assert warming["prompt"] == next(b["prompt"] for b in sent if len(b["prompt"]) == 16)  # hash ids 0, 1, seed 10
    assert by_index[1]["cached_blocks_expected"] == 2 and by_index[2]["cached_blocks_expected"] == 0
    assert run["settings"]["history_requests"] == 1
    settings = run["settings"]
    assert (settings["warm_prompts"], settings["warm_tokens"], settings["warm_failed"]) == (1, 16, 0)


def test_warm_history_without_a_start_is_a_usage_error(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    trace.write_text(json.dumps(TRACE[0]) + "\n")
    with pytest.raises(SystemExit) as stop:
        main(["bench", "--trace", str(trace), "--base-url", "http://127.0.0.1:9", "--warm-history"])
    assert stop.value.code == 2
    assert "--warm-history warms what the window shares with the requests before --start" in capsys.readouterr().err


def test_a_load_given_twice_runs_twice_and_keeps_both_runs(tmp_path):
    code = bench(tmp_path, FakeServer({}, default=Script()), "--time-scale", "1", "1", "--seed", "4")
    assert code == 0
    runs = sorted(p.name for p in (tmp_path / "out").glob("*.json"))
    assert runs == ["fake-x1-seed4.json", "fake-x1-seed5.json"]


@pytest.mark.parametrize("cap, lengths", [("0", [34, 32, 9]), ("20", [20, 20, 9])])
def test_max_input_0_sends_the_traces_lengths_scaled_and_a_cap_truncates(tmp_path, cap, lengths):
    code = bench(tmp_path, FakeServer({}, default=Script()), "--block-tokens", "16", "--max-input", cap)
    assert code == 0
    run = json.loads((tmp_path / "out" / "fake-x1.json").read_text())
    assert [r["input_tokens"] for r in run["requests"]] == lengths  # 1100, 1024, 300 x 16 / 512, rounded
    assert run["settings"]["max_input"] == (None if cap == "0" else 20)
