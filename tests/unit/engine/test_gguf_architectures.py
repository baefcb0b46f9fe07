"""Each architecture's GGUF file, made by llama.cpp's converter from the tiny checkpoint,
loads as the same model as the folder: its metadata mapped to the same config, its
tensors to the same weights, its tokenizer to the same ids (F32 and F16 files)."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from libs.engine.model import steps
from libs.engine.model.engine import EngineConfig
from libs.engine.model.loader import build_engine, load_model
from libs.engine.model.sequence import Sequence
from tests.conftest import TINY_ARCHITECTURES, tiny_architecture, tiny_architecture_gguf
from tests.unit.engine.test_parity import ATOL, random_ids

ARCHITECTURES = sorted(TINY_ARCHITECTURES)


def logits(loaded, ids: list[int]) -> torch.Tensor:
    engine = build_engine(loaded, EngineConfig(num_blocks=64))
    seq = Sequence.from_prompt("p", ids[:-4])
    prefill = steps.prefill_all_logits(engine, [seq])[0]
    decoded = []
    for token in ids[-4:]:  # and four decode steps
        seq.append_token(token)
        decoded.append(steps.decode(engine, [seq])[0])
    return torch.cat([prefill, torch.stack(decoded)])


def f16_rounded(folder, tmp_path):
    """The folder with what an F16 GGUF rounds (every matrix; norms and biases stay F32)."""
    import shutil

    rounded = tmp_path / "rounded"
    shutil.copytree(folder, rounded)
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({k: v.half().float() if v.dim() == 2 else v for k, v in tensors.items()},
              str(rounded / "model.safetensors"), metadata={"format": "pt"})  # fmt: skip
    return rounded


@pytest.mark.parametrize("outtype", ["f32", "f16"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_gguf_of_each_architecture_computes_what_its_folder_does(arch, outtype, tmp_path):
    gguf = tiny_architecture_gguf(arch, outtype)
    folder = tiny_architecture(arch)
    if outtype == "f16":
        folder = f16_rounded(folder, tmp_path)
    from_gguf = load_model(str(gguf), dtype="float32", quantization="none", progress=False)
    from_folder = load_model(str(folder), dtype="float32", quantization="none", progress=False)
    ours, theirs = from_gguf.model.config, from_folder.model.config
    assert (ours.model_type, ours.qkv_bias, ours.qk_norm, ours.tie_word_embeddings) == \
        (theirs.model_type if theirs.model_type != "mistral" else "llama", theirs.qkv_bias, theirs.qk_norm,
         theirs.tie_word_embeddings)  # fmt: skip
    text = "Hello, world! 12345 tokens\n\tand spaces"
    assert from_gguf.tokenizer.encode(text) == from_folder.tokenizer.encode(text)
    chat = [{"role": "user", "content": "hi"}]
    assert from_gguf.tokenizer.encode_chat(chat) == from_folder.tokenizer.encode_chat(chat)
    ids = random_ids(120, seed=4)
    assert (logits(from_gguf, ids) - logits(from_folder, ids)).abs().max().item() < ATOL


def test_an_unsupported_gguf_architecture_is_refused_in_one_line_naming_it(tmp_path):
    gguf = pytest.importorskip("gguf")
    from libs.protocol.errors import UnsupportedModelError

    path = tmp_path / "gemma.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma2")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError) as refused:
        load_model(str(path), dtype="float32", progress=False)
    assert "GGUF architecture 'gemma2' is not supported" in str(refused.value)
    assert "\n" not in str(refused.value)


def test_a_qwen2_gguf_pre_tokenizes_digits_one_at_a_time_as_qwen_does():
    """tokenizer.ggml.pre "qwen2": Qwen2's split regex (llama-bpe's, but single digits)."""
    import json

    from tokenizers import Tokenizer

    from libs.engine.model.gguf_checkpoint import PRE_TOKENIZERS

    def words(pre: str) -> list[str]:
        bare = {"version": "1.0", "model": {"type": "BPE", "vocab": {}, "merges": []},
                "pre_tokenizer": PRE_TOKENIZERS[pre]}  # fmt: skip
        return [w for w, _ in Tokenizer.from_str(json.dumps(bare)).pre_tokenizer.pre_tokenize_str("It's 12345 apples")]

    assert words("qwen2") == ["It", "'s", "Ġ", "1", "2", "3", "4", "5", "Ġapples"]
    assert words("llama-bpe") == ["It", "'s", "Ġ", "123", "45", "Ġapples"]
