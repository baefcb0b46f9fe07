"""The simulator: deterministic for a seed, decode batches timed in closed form
exactly as step by step, and, on the shared Mooncake trace, the paper's ordering."""

from math import ceil
from pathlib import Path
from statistics import median

import msgspec
import pytest

from libs.engine.cost_model import CostModel, reference_coefficients
from services.conductor.simulator.report import plot, summarize, table
from services.conductor.simulator.simulation import SimConfig, simulate
from services.conductor.simulator.trace import TraceRequest, load_trace

TRACE = Path(__file__).resolve().parents[3].parent / "shared" / "traces" / "conversation_trace.jsonl"


def synthetic(n: int = 60) -> list[TraceRequest]:
    """Requests sharing two 4-block prefixes, two a second."""
    return [TraceRequest(i, i * 0.5, 4000 + 100 * (i % 7), 5 + i % 11, (i % 2, i % 2 + 10, i % 2 + 20, i % 2 + 30,
                                                                     1000 + i))
            for i in range(n)]  # fmt: skip


def outcomes(result) -> list[tuple]:
    return [(r.request_id, r.outcome, r.first_token, r.finish, r.decision.prefill_id if r.decision else None)
            for r in result.requests]  # fmt: skip


def test_a_seed_replays_exactly_and_another_seed_does_not():
    trace = synthetic()
    first = simulate(SimConfig(3, 2, "random", seed=4), trace)
    again = simulate(SimConfig(3, 2, "random", seed=4), trace)
    other = simulate(SimConfig(3, 2, "random", seed=5), trace)
    assert outcomes(first) == outcomes(again)
    assert outcomes(first) != outcomes(other)
    assert all(r.outcome == "done" for r in first.requests)


def test_a_lone_decode_takes_exactly_the_sum_of_its_step_times():
    cost = CostModel(reference_coefficients())
    request = TraceRequest(0, 0.0, 1000, 50, (1, 2))
    result = simulate(SimConfig(1, 1, "cache_aware", noise=0.0, store_blocks=0), [request])
    r = result.requests[0]
    steps = sum(cost.decode_step_time(1, 1001 + i) for i in range(49))
    assert r.finish - r.first_token == pytest.approx(steps)
    assert r.first_token == pytest.approx(cost.prefill_time(1000) + cost.transfer_time(2))


def test_two_overlapping_decodes_match_a_step_by_step_replay():
    cost = CostModel(reference_coefficients())
    a, b = TraceRequest(0, 0.0, 600, 40, (1, 2)), TraceRequest(1, 0.5, 600, 30, (3, 4))
    result = simulate(SimConfig(2, 1, "least_loaded", noise=0.0, store_blocks=0), [a, b])
    ra, rb = result.requests
    # step by step: each request joins at the first boundary after its first token
    t, batch, finish = ra.first_token, {"a": [39, 601]}, {}
    pending = {"b": (rb.first_token, [29, 601])}
    while batch or pending:
        for name, (ready, state) in list(pending.items()):
            if ready <= t:
                batch[name] = state
                del pending[name]
        if not batch:
            t = min(ready for ready, _ in pending.values())
            continue
        t += cost.decode_step_time(len(batch), sum(ctx for _, ctx in batch.values()))
        for name in list(batch):
            batch[name][0] -= 1
            batch[name][1] += 1
            if batch[name][0] == 0:
                finish[name] = t
                del batch[name]
    assert (ra.finish, rb.finish) == pytest.approx((finish["a"], finish["b"]))


def test_a_decode_instance_prefills_a_prompt_a_chunk_between_two_decode_steps():
    c = msgspec.structs.replace(reference_coefficients(), transfer_per_block=10.0)  # a hand-off dearer than a prefill
    cost = CostModel(c)
    a = TraceRequest(0, 0.0, 48, 400, (1,))  # decoding when b comes
    b = TraceRequest(1, 1.5, 640, 5, (2, 3))
    runs = {chunk: simulate(SimConfig(1, 1, "cache_aware+local_prefill", noise=0.0, store_blocks=0, coefficients=c,
                                      decode_chunk_tokens=chunk), [a, b]).requests
            for chunk in (64, None)}  # fmt: skip
    assert all(r.decision.prefill_on_decode for requests in runs.values() for r in requests)
    chunks = ceil(cost.prefill_time(640) / cost.prefill_time(64))
    assert chunks == 3
    # the same boundary starts b's prefill; cut in chunks, a decode step of a runs between two of them
    step = cost.decode_step_time(1, 100)  # a's context then: ~60 tokens past its prompt
    assert runs[64][1].first_token - runs[None][1].first_token == pytest.approx((chunks - 1) * step, rel=1e-3)
    assert runs[64][0].finish == pytest.approx(runs[None][0].finish)  # a waits as long in all, only in pieces


def test_the_report_and_the_plot(tmp_path):
    results = [simulate(SimConfig(2, 2, p), synthetic()) for p in ("random", "cache_aware")]
    summaries = [summarize(r) for r in results]
    text = table(summaries)
    assert text.splitlines()[0].startswith("policy") and "cache_aware" in text.splitlines()[3]
    assert summaries[1].requests == 60 and summaries[1].rejected == 0
    assert summaries[1].cache_hit_rate > 0
    png = plot(results, tmp_path / "sim.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def shared_trace():
    if not TRACE.is_file():
        pytest.skip(f"the shared trace is not at {TRACE}")
    return load_trace(TRACE, time_scale=0.5, max_requests=3000)


def test_on_the_shared_trace_cache_aware_beats_least_loaded_beats_random(shared_trace):
    # the instances compute the shortest work first, so a mean TTFT is the long prompts' waits;
    # routing shows in how many requests meet their SLOs, and in the median
    attained, median_ttft = {}, {}
    for policy in ("random", "least_loaded", "cache_aware"):
        result = simulate(SimConfig(16, 16, policy), shared_trace)
        attained[policy] = summarize(result).slo_attainment
        median_ttft[policy] = median(r.ttft for r in result.requests if r.outcome == "done")
    assert attained["cache_aware"] > attained["least_loaded"] > attained["random"]
    assert median_ttft["cache_aware"] < median_ttft["least_loaded"] < median_ttft["random"]


def test_on_the_shared_trace_at_overload_admission_keeps_its_promise(shared_trace):
    for policy in ("cache_aware+early_rejection", "cache_aware+predictive_rejection"):
        s = summarize(simulate(SimConfig(6, 2, policy), shared_trace))
        assert s.rejected > len(shared_trace) // 10  # overloaded
        assert s.kept >= 0.95, policy
        assert s.wasted <= len(shared_trace) // 100, policy


def test_kvserve_simulate_on_a_trace_file_with_a_cost_model_file(tmp_path, capsys):
    import json

    import msgspec

    from kvserve.cli.main import main
    from kvserve.cli.simulate import _coefficients

    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": int(r.arrival_s * 1000), "input_length": r.input_length,
                                         "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n"
                             for r in synthetic(20)))  # fmt: skip
    calibrated = msgspec.structs.replace(reference_coefficients(16), load_per_block={"dram": 0.001})
    cost = tmp_path / "cost.json"
    cost.write_bytes(msgspec.json.encode(calibrated))
    scaled = _coefficients(str(cost))  # per-block terms scale to the trace's 512-token blocks
    assert (scaled.block_size, scaled.load_per_block) == (512, {"dram": 0.032})
    assert scaled.transfer_per_block == pytest.approx(calibrated.transfer_per_block * 32)
    assert main(["simulate", "--trace", str(trace), "--prefill", "2", "--decode", "1", "--policy",
                 "least_loaded,cache_aware+early_rejection", "--cost-model", str(cost), "--out", str(tmp_path / "o")]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "20 requests of trace.jsonl" in out
    assert [line.split()[0] for line in out.splitlines()[3:5]] == ["least_loaded", "cache_aware+early_rejection"]
    assert (tmp_path / "o" / "simulate.png").is_file()
    assert [s["policy"] for s in json.loads((tmp_path / "o" / "summary.json").read_text())] == [
        "least_loaded", "cache_aware+early_rejection"]


def test_on_a_swinging_load_predictive_rejection_refuses_up_front_what_early_rejection_wastes():
    from services.conductor.simulator.scenarios import swinging

    trace = swinging()
    early, predictive = (summarize(simulate(SimConfig(32, 1, p), trace))
                         for p in ("cache_aware+early_rejection", "cache_aware+predictive_rejection"))  # fmt: skip
    # bursts fill the one decode batch while their prefills are in flight: early rejection
    # sees the batch of now, admits, and the decode worker refuses the prefilled requests
    assert early.wasted >= 50 and predictive.wasted <= early.wasted // 10
    assert predictive.rejected > early.rejected
    assert predictive.kept >= 0.95 > early.kept


def test_replication_copies_a_hot_prefix_from_a_busy_holder():
    from services.conductor.simulator.scenarios import hot_prefix

    trace = hot_prefix(rate=5.0, prefixes=20)
    plain, replicated = (simulate(SimConfig(8, 8, p, store_blocks=0, prefill_cache_blocks=400), trace)
                         for p in ("cache_aware", "cache_aware+replication"))  # fmt: skip
    copied = [r for r in replicated.requests if r.cached_tokens.get("peer")]
    # a busy holder's short requests still go first, so fewer need copying than under FIFO queues
    assert len(copied) >= 10 and not any(r.cached_tokens.get("peer") for r in plain.requests)
    assert summarize(replicated).ttft_p99 < summarize(plain).ttft_p99
