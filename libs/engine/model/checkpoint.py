"""Opens a model checkpoint: a Hugging Face folder (config.json, *.safetensors,
tokenizer.json) or a single GGUF file, behind one small interface.

Loading weights into a model is `loader.py`'s job; this module only finds and
reads files, and turns every way they can be missing or damaged into one
error a user can act on.
"""

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer as HFTokenizer

from libs.engine.model.config import ModelConfig
from libs.engine.model.quant import NONE, QuantizedWeight
from libs.engine.model.tokenizer import Tokenizer
from libs.protocol.errors import ModelCorruptError, ModelNotFoundError


@dataclass
class Checkpoint:
    path: Path
    model_id: str
    hf_config: dict[str, Any]
    generation_config: dict[str, Any]

    @property
    def config(self) -> ModelConfig:
        return ModelConfig.from_hf(self.hf_config)

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.generation_config.get("eos_token_id", self.hf_config.get("eos_token_id"))
        if eos is None:
            return []
        return list(eos) if isinstance(eos, list) else [eos]

    def tensors(self, keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        """(HF name, tensor) for every weight; with ``keep_quantized``, weights that ship
        quantized may come as ``QuantizedWeight`` instead of float."""
        raise NotImplementedError

    def native_quantization(self) -> str:
        """What ``quantization="auto"`` loads: the precision the weights ship in."""
        return NONE

    def tokenizer(self) -> Tokenizer:
        raise NotImplementedError


class HFCheckpoint(Checkpoint):
    def tensors(self, keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        from safetensors import SafetensorError, safe_open

        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise ModelNotFoundError(f"{self.path} has no *.safetensors weights")
        for file in files:
            try:
                with safe_open(str(file), framework="pt") as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name)
            except (SafetensorError, OSError) as e:
                raise ModelCorruptError(f"cannot read {file}: {e}") from e

    def tokenizer(self) -> Tokenizer:
        try:
            return Tokenizer.from_dir(self.path, self.eos_token_ids)
        except Exception as e:
            if isinstance(e, ModelNotFoundError):
                raise
            raise ModelCorruptError(f"cannot read the tokenizer in {self.path}: {e}") from e


class GGUFFileCheckpoint(Checkpoint):
    def __init__(self, path: Path) -> None:
        from libs.engine.model.gguf_checkpoint import GGUFCheckpoint

        self.gguf = GGUFCheckpoint(path)
        super().__init__(path, path.stem, self.gguf.hf_config(), self.gguf.generation_config())

    def tensors(self, keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        return self.gguf.tensors(keep_quantized)

    def native_quantization(self) -> str:
        return self.gguf.native_quantization()

    def tokenizer(self) -> Tokenizer:
        return Tokenizer(HFTokenizer.from_str(self.gguf.tokenizer_json()), self.gguf.tokenizer_config(), self.eos_token_ids)


def open_checkpoint(path: Path, model_id: str | None = None) -> Checkpoint:
    """Open a HF checkpoint folder or a .gguf file; ``model_id`` defaults to its name."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"model not found: {path}")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFoundError(f"{path} is neither a checkpoint folder nor a .gguf file")
        checkpoint: Checkpoint = GGUFFileCheckpoint(path)
    else:
        config_file = path / "config.json"
        if not config_file.exists():
            raise ModelNotFoundError(f"{path} has no config.json: not a Hugging Face checkpoint folder")
        generation_file = path / "generation_config.json"
        try:
            hf_config = json.loads(config_file.read_text())
            generation = json.loads(generation_file.read_text()) if generation_file.exists() else {}
        except json.JSONDecodeError as e:
            raise ModelCorruptError(f"cannot parse {config_file.parent}'s JSON: {e}") from e
        checkpoint = HFCheckpoint(path, path.name, hf_config, generation)
    if model_id:
        checkpoint.model_id = model_id
    return checkpoint
