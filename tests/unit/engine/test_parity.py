"""Our transformer against Hugging Face transformers on the same weights."""

import pytest
import torch

from libs.engine.model import steps
from libs.engine.model.engine import EngineConfig
from libs.engine.model.loader import build_engine, load_model
from libs.engine.model.sequence import Sequence
from tests.conftest import TINY_ARCHITECTURES, make_tiny_checkpoint, tiny_architecture

# float32 rounding for a handful of layers: logits agree to ~1e-6 relative, and
# differ only where matmuls accumulate in a different order (fused q/k/v, gate/up).
ATOL = 1e-4


def our_logits(loaded, ids: list[int]) -> torch.Tensor:
    engine = build_engine(loaded, EngineConfig(num_blocks=64, max_chunk_tokens=4096))
    return steps.prefill_all_logits(engine, [Sequence.from_prompt("p", ids)])[0]


def hf_logits(path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def random_ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


ARCHITECTURES = sorted(TINY_ARCHITECTURES)


@pytest.fixture(scope="module", params=ARCHITECTURES)
def architecture(request):
    """(checkpoint folder, loaded float32, transformers' logits for 200 random tokens + 8)."""
    path = tiny_architecture(request.param)
    loaded = load_model(str(path), dtype="float32", quantization="none", progress=False)
    ids = random_ids(208)
    return path, loaded, ids, hf_logits(path, ids)


def test_prefill_logits_match_transformers(architecture):
    _, loaded, ids, ref = architecture
    ours = our_logits(loaded, ids)
    assert ours.shape == ref.shape == (208, 320)
    assert (ours - ref).abs().max().item() < ATOL


def test_decode_logits_match_transformers(architecture):
    """Prefill 200 tokens (13 blocks of the paged pool), then decode the next 8 one at a time:
    each step's logits are transformers' at that position."""
    _, loaded, ids, ref = architecture
    engine = build_engine(loaded, EngineConfig(num_blocks=64))
    seq = Sequence.from_prompt("p", ids[:200])
    steps.prefill(engine, [seq])
    for position in range(200, 208):
        seq.append_token(ids[position])
        logits = steps.decode(engine, [seq])[0]
        assert (logits - ref[position]).abs().max().item() < ATOL


def test_prefix_cached_prefill_matches_transformers(architecture):
    _, loaded, ids, ref = architecture
    engine = build_engine(loaded, EngineConfig(num_blocks=64))
    steps.prefill(engine, [Sequence.from_prompt("head", ids[:96])])
    rest = Sequence.from_prompt("rest", ids)
    assert engine.cache.match_prefix(rest) == 96  # six blocks read from the pool, not recomputed
    logits = steps.prefill_all_logits(engine, [rest])[0]
    assert (logits - ref[96:]).abs().max().item() < ATOL


def test_chunked_prefill_matches_transformers(architecture):
    _, loaded, ids, ref = architecture
    engine = build_engine(loaded, EngineConfig(num_blocks=64, max_chunk_tokens=37, enable_prefix_cache=False))
    logits = steps.prefill_all_logits(engine, [Sequence.from_prompt("p", ids)])[0]
    assert (logits - ref).abs().max().item() < ATOL


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


def test_a_sliding_window_serves_a_context_as_long_as_the_window(tmp_path):
    """Mistral 7B v0.1's kind of config: within the window, sliding-window attention is full
    attention, so the context is cut to the window and the logits are transformers'."""
    from libs.protocol.errors import PromptTooLongError
    from tests.conftest import make_tiny_architecture

    path = make_tiny_architecture(tmp_path / "windowed", "mistral", seed=2, sliding_window=48)
    loaded = load_model(str(path), dtype="float32", quantization="none", progress=False)
    assert loaded.model.config.max_position_embeddings == 48
    engine = build_engine(loaded, EngineConfig(num_blocks=64))
    with pytest.raises(PromptTooLongError):
        engine.check_prompt(49)
    ids = random_ids(48)
    assert (our_logits(loaded, ids) - hf_logits(path, ids)).abs().max().item() < ATOL


@pytest.mark.parametrize(
    "overrides, named",
    [
        ({"model_type": "gemma2"}, "unsupported model_type 'gemma2'"),
        ({"model_type": "phi3", "rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}},
         "phi3: rope scaling 'longrope' is not supported"),
        ({"model_type": "phi3", "partial_rotary_factor": 0.5}, "phi3: partial rotary embeddings"),
        ({"hidden_act": "gelu"}, "llama: activation 'gelu' is not supported"),
    ],
    ids=["architecture", "phi3-longrope", "partial-rotary", "activation"],
)
def test_an_unsupported_architecture_is_refused_in_one_line_naming_it(tmp_path, overrides, named):
    import json

    from libs.protocol.errors import UnsupportedModelError

    path = make_tiny_checkpoint(tmp_path / "tiny")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **overrides}))
    with pytest.raises(UnsupportedModelError) as refused:
        load_model(str(path), dtype="float32", progress=False)
    message = str(refused.value)
    assert named in message and "\n" not in message
