"""A GGUF whose tokenizer is SentencePiece BPE (``tokenizer.ggml.model`` "llama": Llama 2,
Mistral, TinyLlama, Phi-3) tokenizes as SentencePiece itself does: a model trained here
with the sentencepiece library (byte fallback on), written into a GGUF as llama.cpp's
converter writes it (pieces, scores, token types), read back by kvserve."""

import io
import random

import gguf
import pytest
from tokenizers import Tokenizer as HFTokenizer

from libs.engine.model.gguf_checkpoint import GGUFCheckpoint, sentencepiece_merges
from libs.engine.model.tokenizer import Tokenizer

spm = pytest.importorskip("sentencepiece", reason="sentencepiece is not installed (pip install -e '.[test]')")

WORDS = ("the quick brown fox jumps over a lazy dog while seven small kittens sleep near warm stoves; "
         "numbers 12 345 6789, punctuation: (yes) [no] {maybe}! tabs\tand\nnew lines").split(" ")  # fmt: skip
TEXTS = [
    "Hello world",
    " leading space and  two spaces",
    "the quick brown fox",
    "unseen: Zürich, naïve café, 東京, emoji 🙂",
    "line one\nline two\ttab",
    "",
]


@pytest.fixture(scope="module")
def sp_model() -> "spm.SentencePieceProcessor":
    rng = random.Random(0)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(400)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=model, vocab_size=400, model_type="bpe", byte_fallback=True,
        character_coverage=1.0, bos_id=1, eos_id=2, unk_id=0, pad_id=-1, minloglevel=2, num_threads=1,
        # as Llama's tokenizer was trained: text as it is, a space before it, digits one by one
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=True, split_digits=True,
    )  # fmt: skip
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def _token_type(sp, i: int) -> int:
    if sp.is_unknown(i):
        return gguf.TokenType.UNKNOWN
    if sp.is_control(i):
        return gguf.TokenType.CONTROL
    if sp.is_byte(i):
        return gguf.TokenType.BYTE
    return gguf.TokenType.NORMAL


@pytest.fixture(scope="module")
def gguf_tokenizer(sp_model, tmp_path_factory):
    """The trained model in a GGUF (a tokenizer and nothing else), as kvserve reads it."""
    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    n = sp_model.get_piece_size()
    writer.add_tokenizer_model("llama")
    writer.add_token_list([sp_model.id_to_piece(i) for i in range(n)])
    writer.add_token_scores([sp_model.get_score(i) for i in range(n)])
    writer.add_token_types([_token_type(sp_model, i) for i in range(n)])
    writer.add_bos_token_id(sp_model.bos_id())
    writer.add_eos_token_id(sp_model.eos_id())
    writer.add_unk_token_id(sp_model.unk_id())
    writer.add_add_bos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ckpt = GGUFCheckpoint(path)
    return Tokenizer(HFTokenizer.from_str(ckpt.tokenizer_json()), ckpt.tokenizer_config(), [sp_model.eos_id()])


@pytest.mark.parametrize("text", TEXTS)
def test_encoding_is_sentencepieces(sp_model, gguf_tokenizer, text):
    expected = [sp_model.bos_id(), *sp_model.encode(text)]
    assert gguf_tokenizer.encode(text) == expected
    assert gguf_tokenizer.encode(text, add_special_tokens=False) == expected[1:]


@pytest.mark.parametrize("text", TEXTS)
def test_decoding_gives_the_text_back_whole_and_streamed(sp_model, gguf_tokenizer, text):
    ids = gguf_tokenizer.encode(text, add_special_tokens=False)
    assert gguf_tokenizer.decode(ids) == sp_model.decode(ids) == text
    stream = gguf_tokenizer.decode_stream()
    assert "".join(stream.step(i) for i in ids) == text


def test_each_piece_stands_for_its_bytes(sp_model, gguf_tokenizer):
    """What a grammar matches tokens by: a space for U+2581, a <0xXX> piece its byte."""
    ids = gguf_tokenizer.encode("naïve 🙂 and\ttabs", add_special_tokens=False)
    assert b"".join(gguf_tokenizer.token_bytes(i) for i in ids) == " naïve 🙂 and\ttabs".encode()
    newline = sp_model.piece_to_id("<0x0A>")
    assert gguf_tokenizer.token_bytes(newline) == b"\n"
    assert gguf_tokenizer.special_token_ids >= {sp_model.bos_id(), sp_model.eos_id(), sp_model.unk_id()}


def test_merges_follow_the_merged_pieces_scores():
    pieces = ["<unk>", "a", "b", "c", "ab", "bc", "abc"]
    scores = [0.0, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0]
    assert sentencepiece_merges(pieces, scores) == [["a", "b"], ["b", "c"], ["a", "bc"], ["ab", "c"]]


def test_a_tokenizer_model_it_cannot_read_is_named(tmp_path):
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("bert")
    writer.add_token_list(["a"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(Exception, match="tokenizer model 'bert' is not supported"):
        GGUFCheckpoint(path).tokenizer_json()
