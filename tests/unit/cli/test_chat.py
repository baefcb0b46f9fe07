"""`kvserve chat --stats`: after each answer, how fast its prefill and decode ran."""

import re

import pytest

from kvserve.cli import chat
from kvserve.cli.main import build_parser
from libs.engine.model.loader import load_model

STATS = re.compile(
    r"\[(\d+) prompt tokens, prefill (\d+\.\d{3}) s \((\d+\.\d|-) tok/s\); (\d+) tokens decoded at (\d+\.\d|-) tok/s\]"
)


def _chat(argv: list[str], capsys) -> list[str]:
    args = build_parser().parse_args(["chat", *argv])
    assert args.run(args) == 0
    return capsys.readouterr().out.splitlines()


def test_stats_follow_each_answer_when_asked(tiny_checkpoint, capsys):
    argv = ["--model", str(tiny_checkpoint), "--dtype", "float32", "--prompt", "hello", "--max-tokens", "6"]
    lines = _chat(argv + ["--stats"], capsys)
    match = STATS.fullmatch(lines[-1])
    assert match, lines
    tokenizer = load_model(str(tiny_checkpoint), dtype="float32", progress=False).tokenizer
    assert int(match.group(1)) == len(tokenizer.encode_chat([{"role": "user", "content": "hello"}]))
    assert int(match.group(4)) == 5  # 6 tokens (a random model does not stop early): the first is prefill's
    assert not any(STATS.search(line) for line in _chat(argv, capsys))  # not asked: not printed


def test_stats_read_as_rates():
    stats = chat.AnswerStats(prompt_tokens=120, prefill_s=0.5, decode_tokens=30, decode_s=1.5)
    assert stats.describe() == "[120 prompt tokens, prefill 0.500 s (240.0 tok/s); 30 tokens decoded at 20.0 tok/s]"
    one = chat.AnswerStats(prompt_tokens=8, prefill_s=0.0, decode_tokens=0, decode_s=0.0)
    assert one.describe() == "[8 prompt tokens, prefill 0.000 s (- tok/s)]"


def test_the_help_says_what_stats_prints(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["chat", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--stats" in help_text and "prefill tokens/s" in help_text and "decode tokens/s" in help_text
