"""bench/replay.py's options: `--max-input 0` is no cap."""

from bench.replay import parser


def test_max_input_0_is_no_cap_and_the_default_stays_1024():
    assert parser().parse_args(["--max-input", "0"]).max_input is None
    assert parser().parse_args(["--max-input", "2048"]).max_input == 2048
    assert parser().parse_args([]).max_input == 1024
