"""The architecture of a checkpoint, read from its config.json, as the options of
the one forward pass in llama.py.

The families kvserve runs differ in a few switches, not in their shape: Qwen2 adds
biases to q/k/v, Qwen3 normalises each head of q and k, Phi-3 ships q/k/v and
gate/up already fused, Llama 3 scales its rotary frequencies. Only what the forward
pass needs lives here; tokenizer and generation settings belong to `tokenizer.py`
and `checkpoint.py`.
"""

from dataclasses import dataclass
from typing import Any

from libs.protocol.errors import UnsupportedModelError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3")
ROPE_KINDS = ("default", "linear", "llama3", "freq_factors")  # freq_factors: a GGUF's rope_freqs tensor


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # the longest sequence served: the checkpoint's context, or its sliding window where
    # that is shorter (within the window, sliding-window attention is full attention)
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: dict[str, Any] | None = None
    qkv_bias: bool = False  # q/k/v projections carry biases (Qwen2, Llama's attention_bias)
    o_bias: bool = False  # the output projection carries one (Llama's and Qwen3's attention_bias)
    qk_norm: bool = False  # an RMSNorm over each head of q and of k before RoPE (Qwen3)
    model_type: str = "llama"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        model_type = cfg.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"unsupported model_type {model_type!r}; kvserve runs {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        _refuse_unsupported_options(model_type, cfg)
        num_heads = cfg["num_attention_heads"]
        attention_bias = cfg.get("attention_bias", False)
        max_positions = cfg.get("max_position_embeddings", 2048)
        window = _sliding_window(model_type, cfg)
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", 10000.0),
            max_position_embeddings=min(max_positions, window) if window else max_positions,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            rope_scaling=cfg.get("rope_scaling"),
            qkv_bias=model_type == "qwen2" or (model_type != "phi3" and attention_bias),
            o_bias=model_type in ("llama", "mistral", "qwen3") and attention_bias,
            qk_norm=model_type == "qwen3",
            model_type=model_type,
        )


def _refuse_unsupported_options(model_type: str, cfg: dict[str, Any]) -> None:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"{model_type}: activation {act!r} is not supported (silu only)")
    if cfg.get("mlp_bias"):
        raise UnsupportedModelError(f"{model_type}: MLP biases (mlp_bias) are not supported")
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError(
            f"{model_type}: partial rotary embeddings (partial_rotary_factor {cfg['partial_rotary_factor']}) "
            "are not supported"
        )
    scaling = cfg.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_KINDS:
        raise UnsupportedModelError(
            f"{model_type}: rope scaling {kind!r} is not supported (default, linear, llama3)"
        )


def _sliding_window(model_type: str, cfg: dict[str, Any]) -> int | None:
    """The attention window in tokens where some layer attends through one, else None."""
    window = cfg.get("sliding_window")
    if model_type == "llama" or not window:
        return None
    if model_type in ("qwen2", "qwen3"):  # only layers from max_window_layers on, and only if used
        layers = cfg["num_hidden_layers"]
        types = cfg.get("layer_types") or [
            "sliding_attention" if cfg.get("use_sliding_window") and i >= cfg.get("max_window_layers", layers)
            else "full_attention" for i in range(layers)
        ]  # fmt: skip
        if "sliding_attention" not in types:
            return None
    return window
