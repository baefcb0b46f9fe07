"""A GGUF file's metadata and tensor table, read straight from a memory map.

gguf-py's ``GGUFReader`` keeps a numpy view of every part of every metadata field:
for a 49k-token vocabulary and its merges that is ~200k small arrays, 3-4 s of a
worker's every start (and of every restart after a crash). This reads the same
file in a single pass with ``struct`` and hands out what the checkpoint needs:
each field's value as Python values, each tensor's data as the numpy view gguf-py
would give (float types typed, block-quantized types as bytes per row). gguf-py
still provides the type table and the dequantizers.

Layout (GGUF v2/v3, little-endian): magic, version, tensor count, field count; the
fields (key, type, value); the tensor infos (name, dims innermost first, type,
offset); then, aligned to ``general.alignment`` (32), the tensor data.
"""

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
_SCALARS = {  # GGUF value type -> struct format
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}  # fmt: skip
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}  # fmt: skip
_STRING, _ARRAY = 8, 9
_TYPED = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
          "I32": np.int32, "I64": np.int64}  # fmt: skip


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # ggml order: innermost dimension first
    data: np.ndarray  # read-only view: [..., ne0] typed, or [..., bytes per row] for block formats


class GGUFFile:
    """``fields``: key -> value (str, int, float, bool, or a list of them); ``tensors``: in file order.
    Raises ValueError on anything that is not a well-formed GGUF file."""

    def __init__(self, path: Path | str) -> None:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        if self._read(4) != _MAGIC:
            raise ValueError("not a GGUF file (bad magic)")
        (version,) = self._unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
        tensor_count, field_count = self._unpack("<QQ")
        self.fields: dict[str, Any] = {}
        for _ in range(field_count):
            key = self._string()
            (kind,) = self._unpack("<I")
            self.fields[key] = self._value(kind)
        infos = []
        for _ in range(tensor_count):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{n_dims}Q")
            kind, offset = self._unpack("<IQ")
            infos.append((name, dims, kind, offset))
        alignment = int(self.fields.get("general.alignment", 32))
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment} is not a power of two")
        start = -(-self._pos // alignment) * alignment
        buffer = np.frombuffer(self._map, dtype=np.uint8)
        self.tensors: list[GGUFTensor] = []
        seen: set[str] = set()
        for name, dims, kind, offset in infos:
            if name in seen:
                raise ValueError(f"tensor {name!r} appears twice")
            seen.add(name)
            try:
                tensor_type = GGMLQuantizationType(kind)
                block, size = GGML_QUANT_SIZES[tensor_type]
            except (ValueError, KeyError):
                raise ValueError(f"tensor {name!r} has GGML type id {kind}, which is unknown here") from None
            count = int(np.prod(dims, dtype=np.int64))
            if not dims or dims[0] % block:
                raise ValueError(f"tensor {name!r}: shape {dims} does not hold whole {tensor_type.name} blocks")
            nbytes = count // block * size
            begin = start + offset
            if begin + nbytes > len(buffer):
                raise ValueError(f"tensor {name!r} runs past the end of the file")
            raw = buffer[begin : begin + nbytes]
            shape = tuple(reversed(dims))
            typed = _TYPED.get(tensor_type.name)
            if typed is not None:
                data = raw.view(typed).reshape(shape)
            else:
                data = raw.reshape(*shape[:-1], dims[0] // block * size)
            self.tensors.append(GGUFTensor(name, tensor_type, tuple(dims), data))

    def _read(self, n: int) -> bytes:
        end = self._pos + n
        if end > len(self._map):
            raise ValueError("the file ends inside its header")
        data = self._map[self._pos : end]
        self._pos = end
        return data

    def _unpack(self, fmt: str) -> tuple:
        try:
            values = struct.unpack_from(fmt, self._map, self._pos)
        except struct.error:
            raise ValueError("the file ends inside its header") from None
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (length,) = self._unpack("<Q")
        return self._read(length).decode("utf-8")

    def _value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self._unpack(_SCALARS[kind])[0]
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        item, count = self._unpack("<IQ")
        if item in _NUMPY:  # one numpy read for a whole array of numbers
            dtype = np.dtype(_NUMPY[item]).newbyteorder("<")
            values = np.frombuffer(self._read(count * dtype.itemsize), dtype=dtype)
            return values.tolist()
        if item == _STRING:  # each string is length-prefixed: walk them
            out, m, pos = [], self._map, self._pos
            size = len(m)
            for _ in range(count):
                if pos + 8 > size:
                    raise ValueError("the file ends inside its header")
                (length,) = struct.unpack_from("<Q", m, pos)
                pos += 8
                if pos + length > size:
                    raise ValueError("the file ends inside its header")
                out.append(m[pos : pos + length].decode("utf-8"))
                pos += length
            self._pos = pos
            return out
        return [self._value(item) for _ in range(count)]
