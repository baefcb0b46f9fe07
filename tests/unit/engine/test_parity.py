"""Our transformer against Hugging Face transformers on the same weights."""

import pytest
import torch

from libs.engine.model.engine import EngineConfig
from libs.engine.model.loader import build_engine, load_model
from libs.engine.model.sequence import Sequence
from tests.conftest import make_tiny_checkpoint

# float32 rounding for a handful of layers: logits agree to ~1e-6 relative, and
# differ only where matmuls accumulate in a different order (fused q/k/v, gate/up).
ATOL = 1e-4


def our_logits(loaded, ids: list[int]) -> torch.Tensor:
    engine = build_engine(loaded, EngineConfig(num_blocks=64, max_chunk_tokens=4096))
    return engine.prefill_all_logits([Sequence.from_prompt("p", ids)])[0]


def hf_logits(path, ids: list[int]) -> torch.Tensor:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"tie_word_embeddings": True},
        {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "num_key_value_heads": 4},
    ],
    ids=["untied", "tied", "llama3-rope", "linear-rope-mha"],
)
def test_tiny_random_llama_logits_match_transformers(tmp_path, overrides):
    path = make_tiny_checkpoint(tmp_path / "tiny", seed=1, **overrides)
    loaded = load_model(str(path), dtype="float32", quantization="none", progress=False)
    ids = torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    ours, ref = our_logits(loaded, ids), hf_logits(path, ids)
    assert ours.shape == ref.shape == (200, 320)
    assert (ours - ref).abs().max().item() < ATOL


def test_smollm_logits_match_transformers(smollm, hf_smollm):
    ids = smollm.tokenizer.encode_chat([{"role": "user", "content": "Explain paged attention in one paragraph."}])
    ours = our_logits(smollm, ids)
    with torch.no_grad():
        ref = hf_smollm(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() < ATOL


def test_smollm_greedy_64_tokens_match_transformers(smollm, hf_smollm):
    from libs.engine.model.generator import Generator
    from libs.protocol.sampling_params import SamplingParams

    ids = smollm.tokenizer.encode_chat([{"role": "user", "content": "Tell me a story about a lighthouse."}])
    generator = Generator(build_engine(smollm, EngineConfig(num_blocks=64)), smollm.tokenizer)
    ours = generator.generate([ids], SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))[0]
    with torch.no_grad():
        ref = hf_smollm.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=64, min_new_tokens=64, do_sample=False,
        )[0, len(ids):].tolist()  # fmt: skip
    assert len(ours.token_ids) == 64
    assert ours.token_ids == ref


def test_gguf_file_loads_the_same_model_as_the_prepared_folder(smollm):
    from libs.engine.model.default_model import default_gguf_path

    direct = load_model(str(default_gguf_path()), dtype="float32", quantization="none", progress=False)
    ids = smollm.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    assert direct.tokenizer.encode("The quick brown fox jumps over the lazy dog.") == ids
    assert torch.equal(our_logits(direct, ids), our_logits(smollm, ids))
