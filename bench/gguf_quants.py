"""The default model's GGUF file in llama.cpp's other quantizations (Q4_K_M, Q6_K, Q8_0, ...),
made by llama.cpp's own ``llama-quantize`` (bench/llama_cpp.sh builds it) and cached.

``llama-quantize`` starts from a float32 copy of the shipped Q4_1 file (every tensor
dequantized, the metadata as it is), so the new file's values are llama.cpp's rounding
of the Q4_1 values. Used by the tests (which skip with ``Unavailable``'s reason) and by
bench/engine.py.

    python bench/gguf_quants.py Q4_K_M Q6_K   # make them, print their paths
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from libs.engine.model.default_model import DEFAULT_MODEL_ID, cache_dir, default_gguf_path  # noqa: E402

LLAMA_QUANTIZE = ROOT / ".cache" / "llama.cpp" / "bin" / "llama-quantize"


class Unavailable(Exception):
    """A file that cannot be made here, and why."""


def quantized_path(kind: str) -> Path:
    return cache_dir() / "gguf" / f"{DEFAULT_MODEL_ID}.{kind}.gguf"


def default_model_as(kind: str) -> Path:
    """The default model quantized by llama-quantize as ``kind`` (its name for the file type,
    e.g. ``Q4_K_M``): made once, then read from the cache."""
    target = quantized_path(kind)
    if target.is_file():
        return target
    if not LLAMA_QUANTIZE.is_file():
        raise Unavailable(f"{LLAMA_QUANTIZE} is missing: run bench/llama_cpp.sh")
    source = cache_dir() / "gguf" / f"{DEFAULT_MODEL_ID}.F32.gguf"
    if not source.is_file():
        write_float32_copy(default_gguf_path(), source)
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    done = subprocess.run([str(LLAMA_QUANTIZE), str(source), str(partial), kind, "2"], capture_output=True, text=True)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise Unavailable(f"llama-quantize {kind} exited {done.returncode}: {done.stderr.strip()[-300:]}")
    os.replace(partial, target)
    return target


def write_float32_copy(source: Path, target: Path) -> None:
    """``source`` with every tensor dequantized to float32 and its metadata unchanged."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    writer = gguf.GGUFWriter(str(partial), arch=reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # the writer writes these itself
        value = 0 if key == "general.file_type" else field.contents()  # 0: LLAMA_FTYPE_ALL_F32
        kind = gguf.GGUFValueType(field.types[0])
        sub = gguf.GGUFValueType(field.types[-1]) if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, kind, sub)
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        writer.add_tensor(t.name, values.reshape([int(d) for d in reversed(t.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(partial, target)


if __name__ == "__main__":
    for name in sys.argv[1:] or ["Q4_K_M"]:
        print(default_model_as(name))
