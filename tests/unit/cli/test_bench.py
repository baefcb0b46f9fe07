"""`kvserve bench`'s argument checks: a bad value or a contradictory pair exits 2
with one line naming the argument, before any trace is read."""

import pytest

from kvserve.cli.main import main

BASE = ["bench", "--trace", "no-such-trace.jsonl", "--base-url", "http://127.0.0.1:9"]


@pytest.mark.parametrize(
    "extra, line",
    [
        (["--find-capacity", "--max-probes", "0"], "argument --max-probes: must be at least 1, got 0"),
        (["--find-capacity", "--target-attainment", "0"],
         "argument --target-attainment: must be a share of requests in (0, 1], e.g. 0.9; got 0"),
        (["--find-capacity", "--target-attainment", "90"],
         "argument --target-attainment: must be a share of requests in (0, 1], e.g. 0.9; got 90"),
        (["--find-capacity", "--target-attainment", "most"], "argument --target-attainment: not a number: 'most'"),
        (["--find-capacity", "--start-scale", "0"], "argument --start-scale: must be a positive number, got 0"),
        (["--find-capacity", "--start-scale", "inf"], "argument --start-scale: must be a positive number, got inf"),
        (["--find-capacity", "--time-scale", "1", "0.5"],
         "--find-capacity chooses the time scales itself: give --start-scale, not --time-scale"),
        (["--find-capacity", "--start-scale", "4", "--max-scale", "2"], "--max-scale 2 is below the start scale 4"),
        (["--find-capacity", "--max-scale", "0.5"], "--max-scale 0.5 is below the start scale 1"),
        (["--max-probes", "3", "--start-scale", "2"], "--max-probes, --start-scale apply only with --find-capacity"),
        (["--target-attainment", "0.8"], "--target-attainment applies only with --find-capacity"),
    ],
)  # fmt: skip
def test_bad_capacity_arguments_exit_2_with_a_clear_line(extra, line, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(BASE + extra)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"kvserve bench: error: {line}"
