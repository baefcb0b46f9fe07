"""Reads a GGUF file of a Llama-family architecture (llama, which Mistral converts
to, qwen2, qwen3, phi3) as a Hugging Face checkpoint: config (each family's metadata
mapped to the config.json transformers would have), tensors (llama's Q/K rows
un-permuted back to HF's rotary layout; linear weights in a block type gguf_blocks
keeps optionally kept quantized, everything else dequantized to float32) and a
tokenizer.json built from the file's vocabulary and merges.

This is the only module that knows GGUF; everything after it sees HF names.
"""

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from libs.engine.model import gguf_blocks, quant
from libs.engine.model.gguf_file import GGUFFile, GGUFTensor
from libs.protocol.errors import ModelCorruptError, ModelNotFoundError, UnsupportedModelError

log = logging.getLogger(__name__)
_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")

# llama.cpp pre-tokenizer names -> the tokenizers pre-tokenizer that matches them
_DIGITS_THEN_BYTES = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ],
}
_BYTES = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3 = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": _LLAMA3_REGEX}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
    ],
}
_QWEN2_REGEX = _LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")  # digits one at a time
_QWEN2 = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": _QWEN2_REGEX}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
    ],
}
PRE_TOKENIZERS = {
    "smollm": _DIGITS_THEN_BYTES,
    "starcoder": _DIGITS_THEN_BYTES,
    "refact": _DIGITS_THEN_BYTES,
    "gpt-2": _BYTES,
    "default": _BYTES,
    "llama-bpe": _LLAMA3,
    "qwen2": _QWEN2,
}
_TOKEN_TYPE_UNKNOWN, _TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED = 2, 3, 4
_SPACE = "\u2581"  # SentencePiece's stand-in for a space

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_qkv": "self_attn.qkv_proj",  # phi3: q, k and v in one tensor, as in its HF checkpoint
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# general.architecture -> (HF model_type, HF class). Only llama's converter interleaves
# each head's rotary halves (llama.cpp's "normal" RoPE); qwen2, qwen3 and phi3 rotate
# halves as HF does ("neox") and keep HF's rows. phi3's ffn_up holds gate and up fused.
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class GGUFCheckpoint:
    def __init__(self, path: Path) -> None:
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file not found: {path}")
        try:
            self._reader = GGUFFile(path)
        except Exception as e:  # ValueError on damage; gguf's type table raises its own
            raise ModelCorruptError(f"cannot read GGUF file {path}: {e}") from e
        self.path = path
        arch = self._field("general.architecture")
        if arch not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"{path}: GGUF architecture {arch!r} is not supported ({', '.join(ARCHITECTURES)})"
            )
        self.arch = arch

    def _field(self, key: str, default: Any = None) -> Any:
        return self._reader.fields.get(key, default)

    def _has_tensor(self, name: str) -> bool:
        return any(t.name == name for t in self._reader.tensors)

    def hf_config(self) -> dict[str, Any]:
        """The config.json of this file's model; one line naming any option kvserve lacks."""
        arch = self.arch
        f = lambda key, default=None: self._field(f"{arch}.{key}", default)  # noqa: E731
        model_type, hf_class = ARCHITECTURES[arch]
        num_heads = f("attention.head_count")
        hidden = f("embedding_length")
        head_dim = f("attention.key_length") or hidden // num_heads
        if f("rope.dimension_count", head_dim) != head_dim:
            raise UnsupportedModelError(
                f"{self.path}: partial rotary embeddings ({f('rope.dimension_count')} of {head_dim} dims) "
                "are not supported"
            )
        if self._has_tensor("rope_factors_long.weight"):
            raise UnsupportedModelError(f"{self.path}: {arch} rope scaling 'longrope' is not supported")
        config: dict[str, Any] = {
            "architectures": [hf_class],
            "model_type": model_type,
            "hidden_act": "silu",
            "vocab_size": f("vocab_size") or len(self._reader.fields["tokenizer.ggml.tokens"]),
            "hidden_size": hidden,
            "intermediate_size": f("feed_forward_length"),
            "num_hidden_layers": f("block_count"),
            "num_attention_heads": num_heads,
            "num_key_value_heads": f("attention.head_count_kv", num_heads),
            "head_dim": head_dim,
            "rms_norm_eps": f("attention.layer_norm_rms_epsilon", 1e-5),
            "rope_theta": f("rope.freq_base", 10000.0),
            "max_position_embeddings": f("context_length", 2048),
            "tie_word_embeddings": not self._has_tensor("output.weight"),
            "sliding_window": f("attention.sliding_window") or None,  # phi3 writes 0 for none
            "bos_token_id": self._field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self._field("tokenizer.ggml.eos_token_id"),
            "torch_dtype": "float32",
        }
        if arch == "llama" and self._has_tensor("attn_q.bias"):
            config["attention_bias"] = True
        scaling = f("rope.scaling.type")
        if scaling == "linear":
            config["rope_scaling"] = {"rope_type": "linear", "factor": f("rope.scaling.factor")}
        elif scaling not in (None, "none"):
            raise UnsupportedModelError(f"{self.path}: {arch} rope scaling {scaling!r} is not supported")
        freqs = next((t for t in self._reader.tensors if t.name == "rope_freqs.weight"), None)
        if freqs is not None:  # Llama 3.1+: the llama3 scaling, as llama.cpp applies it
            factors = np.asarray(_dequantize(freqs.data, freqs.tensor_type), dtype=np.float32).reshape(-1)
            config["rope_scaling"] = {"rope_type": "freq_factors", "factors": factors.tolist()}
        return config

    def generation_config(self) -> dict[str, Any]:
        return {
            "bos_token_id": self._field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self._field("tokenizer.ggml.eos_token_id"),
            "pad_token_id": self._field("tokenizer.ggml.padding_token_id"),
        }

    def tensors(self, keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor | quant.QuantizedWeight]]:
        """(HF name, tensor) for every weight, one at a time: float32, or with ``keep_quantized``
        a linear weight in a type gguf_blocks keeps in that format (Q4_0/Q4_1/Q4_K as int4
        groups of 32, Q5_0/Q5_1/Q5_K/Q6_K/Q8_0 as int8 per channel)."""
        config = self.hf_config()
        for t in self._reader.tensors:
            name = _hf_name(t.name, self.arch)
            if name is None:
                continue
            kind = t.tensor_type.name
            heads = _rotary_heads(name, config) if self.arch == "llama" else None
            try:
                if keep_quantized and name.endswith("_proj.weight") and kind in gguf_blocks.KEPT:
                    weight = gguf_blocks.unpack(np.asarray(t.data), kind)
                    if heads is not None:  # permute integer and scale rows alike
                        weight = weight.rows(torch.from_numpy(_unpermute_rotary(np.arange(weight.shape[0]), heads)))
                    yield name, weight
                    continue
                array = _dequantize(t.data, t.tensor_type)
            except Exception as e:  # gguf raises bare ValueErrors/NotImplementedErrors on damage
                raise ModelCorruptError(f"{self.path}: cannot read {t.name} ({kind}): {e}") from e
            array = np.asarray(array, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
            if heads is not None:
                array = _unpermute_rotary(array, heads)
            yield name, torch.from_numpy(np.array(array, copy=True, order="C"))

    def native_quantization(self) -> str:
        """What ``auto`` keeps the linear weights in: the one format gguf_blocks keeps all of
        them in (``int4-g32``, ``int8``), ``mixed`` where they differ or some cannot be kept
        (those load float, named in one warning line with their cost), ``none`` where none
        can (a float file, or one whose types all load float)."""
        linears = [t for t in self._reader.tensors if (_hf_name(t.name, self.arch) or "").endswith("_proj.weight")]
        kinds = [t.tensor_type.name for t in linears]
        unkept = [t for t, kind in zip(linears, kinds) if kind not in gguf_blocks.KEPT and kind not in _FLOAT_TYPES]
        if unkept:
            _warn_loaded_float(self.path, unkept)
        formats = {gguf_blocks.KEPT.get(kind) for kind in kinds}
        if formats <= {None}:
            return quant.NONE
        return formats.pop() if len(formats) == 1 else quant.MIXED

    def tensor_count(self) -> int:
        return sum(_hf_name(t.name, self.arch) is not None for t in self._reader.tensors)

    def tokenizer_json(self) -> str:
        """The file's tokenizer as a tokenizers JSON: byte-level BPE (``gpt2``: GPT-2,
        Llama 3, Qwen, SmolLM) with its merges and pre-tokenizer, or SentencePiece BPE
        (``llama``: Llama 2, Mistral, TinyLlama, Phi-3) with merges derived from the pieces'
        scores, as transformers converts a SentencePiece model."""
        f = self._field
        model = f("tokenizer.ggml.model")
        if model == "llama":
            return json.dumps(self._sentencepiece_tokenizer(), ensure_ascii=False)
        if model != "gpt2":
            raise ModelCorruptError(f"{self.path}: tokenizer model {model!r} is not supported "
                                    "(byte-level BPE, gpt2, or SentencePiece BPE, llama)")  # fmt: skip
        pre = f("tokenizer.ggml.pre", "default")
        if pre not in PRE_TOKENIZERS:
            raise ModelCorruptError(f"{self.path}: pre-tokenizer {pre!r} is not supported ({sorted(PRE_TOKENIZERS)})")
        tokens = f("tokenizer.ggml.tokens")
        return json.dumps(
            {
                "version": "1.0",
                "truncation": None,
                "padding": None,
                "added_tokens": self._added_tokens(),
                "normalizer": None,
                "pre_tokenizer": PRE_TOKENIZERS[pre],
                "post_processor": self._post_processor(),
                "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
                "model": {
                    "type": "BPE",
                    "dropout": None,
                    "unk_token": None,
                    "continuing_subword_prefix": None,
                    "end_of_word_suffix": None,
                    "fuse_unk": False,
                    "byte_fallback": False,
                    "ignore_merges": False,
                    "vocab": {token: i for i, token in enumerate(tokens)},
                    "merges": f("tokenizer.ggml.merges") or [],  # a byte vocabulary has none
                },
            },
            ensure_ascii=False,
        )

    def _sentencepiece_tokenizer(self) -> dict[str, Any]:
        """SentencePiece BPE as llama.cpp runs it: a space before the text (and after each
        special token) unless ``add_space_prefix`` is false, spaces as U+2581, the pair
        whose merged piece scores highest merged first, bytes of what no piece covers as
        <0xXX> pieces; decoding undoes each and drops the leading space."""
        f = self._field
        tokens, scores = f("tokenizer.ggml.tokens"), f("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise ModelCorruptError(f"{self.path}: a SentencePiece tokenizer needs a score for each of its pieces")
        unknown = f("tokenizer.ggml.unknown_token_id")
        normalizers: list[dict] = [{"type": "Replace", "pattern": {"String": " "}, "content": _SPACE}]
        if f("tokenizer.ggml.add_space_prefix", True):
            normalizers.insert(0, {"type": "Prepend", "prepend": _SPACE})
        return {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": self._added_tokens(),
            "normalizer": {"type": "Sequence", "normalizers": normalizers},
            "pre_tokenizer": None,
            "post_processor": self._post_processor(),
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": _SPACE}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0},
            ]},  # fmt: skip
            "model": {
                "type": "BPE",
                "dropout": None,
                "unk_token": tokens[unknown] if unknown is not None else None,
                "continuing_subword_prefix": None,
                "end_of_word_suffix": None,
                "fuse_unk": True,
                "byte_fallback": True,
                "ignore_merges": False,
                "vocab": {token: i for i, token in enumerate(tokens)},
                "merges": sentencepiece_merges(tokens, scores),
            },
        }

    def _added_tokens(self) -> list[dict[str, Any]]:
        """The control, unknown and user-defined pieces: matched whole, before the model runs."""
        tokens, types = self._field("tokenizer.ggml.tokens"), self._field("tokenizer.ggml.token_type")
        return [
            {"id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": types[i] != _TOKEN_TYPE_USER_DEFINED}  # fmt: skip
            for i in range(len(tokens))
            if types[i] in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED, _TOKEN_TYPE_UNKNOWN)
        ]

    def _post_processor(self) -> dict[str, Any] | None:
        """The beginning-of-sequence token before the text, where the file asks for it."""
        f = self._field
        if not f("tokenizer.ggml.add_bos_token", False):
            return None
        bos_id = f("tokenizer.ggml.bos_token_id")
        bos = f("tokenizer.ggml.tokens")[bos_id]
        return {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],  # fmt: skip
            "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
        }

    def tokenizer_config(self) -> dict[str, Any]:
        f = self._field
        tokens = f("tokenizer.ggml.tokens")
        config: dict[str, Any] = {
            "add_bos_token": bool(f("tokenizer.ggml.add_bos_token", False)),
            "model_max_length": f(f"{self.arch}.context_length", 2048),
            "tokenizer_class": "PreTrainedTokenizerFast",
            "clean_up_tokenization_spaces": False,
        }
        for key, name in (("bos_token", "bos"), ("eos_token", "eos"), ("pad_token", "padding"), ("unk_token", "unknown")):
            token_id = f(f"tokenizer.ggml.{name}_token_id")
            if token_id is not None:
                config[key] = tokens[token_id]
        template = f("tokenizer.chat_template")
        if template:
            config["chat_template"] = template
        return config


def sentencepiece_merges(pieces: list[str], scores: list[float]) -> list[list[str]]:
    """The BPE merges that reproduce SentencePiece BPE over ``pieces``: every split of a
    piece into two pieces, the merges of higher-scored pieces first (transformers'
    SentencePieceExtractor: within a piece, by the halves' ids)."""
    ids = {piece: i for i, piece in enumerate(pieces)}
    merges = []
    for i, piece in enumerate(pieces):
        local = [(ids[piece[:k]], ids[piece[k:]]) for k in range(1, len(piece)) if piece[:k] in ids and piece[k:] in ids]
        merges += [(-scores[i], i, left, right) for left, right in sorted(local)]
    merges.sort(key=lambda m: m[0])  # stable: ties keep the pieces' order
    return [[pieces[left], pieces[right]] for _, _, left, right in merges]


def _warn_loaded_float(path: Path, tensors: list[GGUFTensor]) -> None:
    """One line: which weights kvserve cannot keep in their GGUF type, and what float costs."""
    count = sum(int(np.prod(t.shape)) for t in tensors)
    stored = sum(t.data.nbytes for t in tensors)
    by_type: dict[str, list[str]] = {}
    for t in tensors:
        by_type.setdefault(t.tensor_type.name, []).append(t.name)
    named = "; ".join(f"{kind}: {_compact(names)}" for kind, names in sorted(by_type.items()))
    log.warning(
        "%s: %d linear weights in GGUF types kvserve cannot keep quantized load float (%s): %.1fM values, "
        "%.1f MB in bfloat16 / %.1f MB in float32 against %.1f MB in the file",
        path.name, len(tensors), named, count / 1e6, 2 * count / 1e6, 4 * count / 1e6, stored / 1e6,
    )  # fmt: skip


def _compact(names: list[str]) -> str:
    """``blk.0.attn_q.weight``, ``blk.1.attn_q.weight`` -> ``blk.{0-1}.attn_q.weight``."""
    layers: dict[str, list[int]] = {}
    others = []
    for name in names:
        match = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
        if match:
            layers.setdefault(match[2], []).append(int(match[1]))
        else:
            others.append(name)
    parts = others[:]
    for suffix, numbers in layers.items():
        spans, numbers = [], sorted(numbers)
        start = prev = numbers[0]
        for n in numbers[1:] + [None]:
            if n is not None and n == prev + 1:
                prev = n
                continue
            spans.append(str(start) if start == prev else f"{start}-{prev}")
            if n is not None:
                start = prev = n
        parts.append(f"blk.{{{','.join(spans)}}}.{suffix}")
    return ", ".join(parts)


def _dequantize(data: np.ndarray, tensor_type) -> np.ndarray:
    import gguf.quants  # imported here: only GGUF users pay for it

    return gguf.quants.dequantize(data, tensor_type)


def _hf_name(gguf_name: str, arch: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
        module = "mlp.gate_up_proj" if arch == "phi3" and parts[2] == "ffn_up" else _LAYER_NAMES[parts[2]]
        return f"model.layers.{parts[1]}.{module}.{parts[3]}"
    if gguf_name == "rope_freqs.weight":
        return None  # llama3 frequency factors: read into the config's rope scaling
    raise ModelCorruptError(f"unknown GGUF tensor {gguf_name!r}")


def _rotary_heads(name: str, config: dict[str, Any]) -> int | None:
    if name.endswith("q_proj.weight"):
        return config["num_attention_heads"]
    if name.endswith("k_proj.weight"):
        return config["num_key_value_heads"]
    return None


def _unpermute_rotary(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of each head's rotary halves (HF keeps them split)."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
