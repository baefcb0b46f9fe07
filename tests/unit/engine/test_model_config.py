"""The architecture fields of each family's published config.json (transcribed: no
download) map to the options of the one forward pass, or to a one-line refusal."""

import pytest

from libs.engine.model.config import ModelConfig
from libs.protocol.errors import UnsupportedModelError

QWEN25_05B = dict(
    model_type="qwen2", hidden_act="silu", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
    num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, max_window_layers=21,
    sliding_window=32768, use_sliding_window=False, rms_norm_eps=1e-6, rope_theta=1000000.0,
    tie_word_embeddings=True, vocab_size=151936,
)  # fmt: skip
QWEN3_06B = dict(
    model_type="qwen3", attention_bias=False, head_dim=128, hidden_act="silu", hidden_size=1024,
    intermediate_size=3072, max_position_embeddings=40960, max_window_layers=28, num_attention_heads=16,
    num_hidden_layers=28, num_key_value_heads=8, rms_norm_eps=1e-6, rope_scaling=None, rope_theta=1000000,
    sliding_window=None, tie_word_embeddings=True, use_sliding_window=False, vocab_size=151936,
)  # fmt: skip
LLAMA32_1B = dict(
    model_type="llama", attention_bias=False, mlp_bias=False, head_dim=64, hidden_act="silu", hidden_size=2048,
    intermediate_size=8192, max_position_embeddings=131072, num_attention_heads=32, num_hidden_layers=16,
    num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True, vocab_size=128256,
    rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                  "original_max_position_embeddings": 8192, "rope_type": "llama3"},
)  # fmt: skip
MISTRAL_7B_V03 = dict(
    model_type="mistral", hidden_act="silu", hidden_size=4096, intermediate_size=14336,
    max_position_embeddings=32768, num_attention_heads=32, num_hidden_layers=32, num_key_value_heads=8,
    rms_norm_eps=1e-5, rope_theta=1000000.0, sliding_window=None, tie_word_embeddings=False, vocab_size=32768,
)  # fmt: skip
MISTRAL_7B_V01 = {**MISTRAL_7B_V03, "sliding_window": 4096, "rope_theta": 10000.0, "vocab_size": 32000}
PHI3_MINI_4K = dict(
    model_type="phi3", hidden_act="silu", hidden_size=3072, intermediate_size=8192, max_position_embeddings=4096,
    original_max_position_embeddings=4096, num_attention_heads=32, num_hidden_layers=32, num_key_value_heads=32,
    rms_norm_eps=1e-5, rope_scaling=None, rope_theta=10000.0, sliding_window=2047, tie_word_embeddings=False,
    vocab_size=32064,
)  # fmt: skip
PHI3_MINI_128K = {**PHI3_MINI_4K, "max_position_embeddings": 131072, "sliding_window": 262144,
                  "rope_scaling": {"type": "longrope", "long_factor": [1.0] * 48, "short_factor": [1.0] * 48}}  # fmt: skip


def options(c: ModelConfig) -> tuple:
    return c.model_type, c.qkv_bias, c.o_bias, c.qk_norm, c.head_dim, c.max_position_embeddings, c.tie_word_embeddings


@pytest.mark.parametrize(
    "hf, expected",
    [
        (QWEN25_05B, ("qwen2", True, False, False, 64, 32768, True)),  # biases; its window unused
        (QWEN3_06B, ("qwen3", False, False, True, 128, 40960, True)),  # q/k norms; head_dim > hidden/heads
        (LLAMA32_1B, ("llama", False, False, False, 64, 131072, True)),
        (MISTRAL_7B_V03, ("mistral", False, False, False, 128, 32768, False)),
        (MISTRAL_7B_V01, ("mistral", False, False, False, 128, 4096, False)),  # cut to its window
        (PHI3_MINI_4K, ("phi3", False, False, False, 96, 2047, False)),  # cut to its window
    ],
    ids=["qwen2.5-0.5b", "qwen3-0.6b", "llama3.2-1b", "mistral-7b-v0.3", "mistral-7b-v0.1", "phi3-mini-4k"],
)
def test_each_familys_published_config_maps_to_its_options(hf, expected):
    assert options(ModelConfig.from_hf(hf)) == expected


def test_phi3_128k_longrope_is_refused_naming_it():
    with pytest.raises(UnsupportedModelError, match="^phi3: rope scaling 'longrope' is not supported"):
        ModelConfig.from_hf(PHI3_MINI_128K)


def test_qwen2_sliding_window_counts_only_where_a_layer_uses_it():
    used = {**QWEN25_05B, "use_sliding_window": True, "sliding_window": 4096}
    assert ModelConfig.from_hf(used).max_position_embeddings == 4096  # layers 21-23 slide
    above = {**used, "max_window_layers": 24}
    assert ModelConfig.from_hf(above).max_position_embeddings == 32768  # none does
