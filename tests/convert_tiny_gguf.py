"""Runs llama.cpp's convert_hf_to_gguf.py on a tiny test checkpoint:
``python convert_tiny_gguf.py LLAMA_CPP_SOURCES FOLDER OUTFILE OUTTYPE``.

The tiny checkpoints' tokenizer is a bare byte-level BPE (conftest.write_byte_tokenizer)
that no published model uses, so the converter would not recognise it: here it is
converted as GPT-2's, whose pre-tokenizer it has, and never as a SentencePiece model
(the tiny folders have no tokenizer.model). Everything else is the converter's own.
"""

import sys

sources, folder, outfile, outtype = sys.argv[1:5]
sys.path.insert(0, sources)
sys.argv = ["convert_hf_to_gguf.py", folder, "--outfile", outfile, "--outtype", outtype]

from conversion import base, phi  # noqa: E402  (importable only once sources is on the path)

base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
phi.Phi3MiniModel.set_vocab = base.TextModel._set_vocab_gpt2


def _no_sentencepiece(self):
    raise FileNotFoundError("the tiny checkpoints have no tokenizer.model")


base.TextModel._create_vocab_sentencepiece = _no_sentencepiece

import convert_hf_to_gguf  # noqa: E402

convert_hf_to_gguf.main()
