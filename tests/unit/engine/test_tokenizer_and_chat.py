"""Tokenization and chat templates, and `kvserve chat` answering for real."""

import subprocess
import sys

from tests.conftest import make_tiny_checkpoint


def test_smollm_chat_template_renders_the_checkpoint_template(smollm):
    text = smollm.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = smollm.tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    assert ids[0] == smollm.tokenizer.token_to_id("<|im_start|>")  # special tokens parsed, no extra BOS
    assert smollm.tokenizer.decode(ids, skip_special_tokens=False) == text


def test_smollm_tokenizer_matches_transformers_gguf_tokenizer(smollm):
    from transformers import AutoTokenizer

    from libs.engine.model.default_model import default_gguf_path

    gguf = default_gguf_path()
    ref = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    for text in ["Hello world", "12345 apples cost $3.50!", "  spaces\n\n\ttabs", "naïve café 東京 🤖",
                 "<|im_start|>user\nhi<|im_end|>", "don't you'll I'M"]:  # fmt: skip
        assert smollm.tokenizer.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)


def test_end_of_turn_is_the_stop_token(smollm):
    assert smollm.tokenizer.eos_token_ids == [smollm.tokenizer.token_to_id("<|im_end|>")]


def test_chat_answers_the_capital_of_france():
    result = subprocess.run(
        [sys.executable, "-m", "kvserve.cli.main", "chat", "--prompt", "What is the capital of France?"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_interactive_chat_keeps_the_conversation(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "tiny")
    result = subprocess.run(
        [sys.executable, "-m", "kvserve.cli.main", "chat", "--model", str(path), "--dtype", "float32",
         "--max-tokens", "5"],
        input="hello\n/reset\nagain\n", capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("> ") == 4  # three inputs read, then end of input


def test_token_bytes_are_the_exact_bytes_each_token_stands_for(smollm):
    tok = smollm.tokenizer
    text = "ok 😀 héllo"
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    assert b"\xf0\x9f\x98" in [tok.token_bytes(i)[-3:] for i in ids]  # the emoji split across tokens
    assert tok.token_bytes(tok.token_to_id("<|im_end|>")) == b"<|im_end|>"
