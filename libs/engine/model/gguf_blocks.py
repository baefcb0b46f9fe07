"""GGUF's quantized block formats: their values exactly as ggml computes them, and the
kernel format (quant.py) each is kept in.

| GGUF type        | kept as                  | how                                                  |
|------------------|--------------------------|------------------------------------------------------|
| Q4_0, Q4_1, Q4_K | int4 groups of 32        | the 4-bit values and one scale and zero per 32       |
| Q5_0, Q5_1, Q5_K | int8, one scale per row  | requantized: no CPU kernel takes 5-bit values        |
| Q6_K, Q8_0       | int8, one scale per row  | requantized: int8's kernel has no per-block scales   |

Int4 is exact in float32: a Q4_K sub-block (32 weights) is ``d·sc·q − dmin·m`` with
``q`` in 0..15 and 6-bit ``sc``, ``m``; ``(q − 8)·scale + zero`` with ``scale = d·sc``
(exact: 11 × 6 bits) and ``zero = 8·d·sc − dmin·m`` is the same value rounded once,
whenever ``zero`` is a float32 (the two products' exponents within ~6 of each other).
With bfloat16 activations the kernel takes scale and zero in bfloat16: that cast is
where Q4_0/Q4_1/Q4_K weights round (each scale and zero to 8 significant bits), and
only there. Requantizing to int8 moves each weight by at most half its row's step,
``max|row| / 254``. This module knows the block layouts but not the GGUF file.
"""

import numpy as np
import torch

from libs.engine.model.quant import INT8, Int4Groups, Int8Channels, QuantizedWeight, quantize_int8

QK = 32  # weights per block of the simple types
QK_K = 256  # weights per super-block of the K types
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
BLOCK_WEIGHTS = {kind: QK_K if kind.endswith("_K") else QK for kind in BLOCK_BYTES}
INT4 = f"int4-g{QK}"
KEPT = {"Q4_0": INT4, "Q4_1": INT4, "Q4_K": INT4,
        "Q5_0": INT8, "Q5_1": INT8, "Q5_K": INT8, "Q6_K": INT8, "Q8_0": INT8}  # fmt: skip


def _blocks(raw: np.ndarray, kind: str) -> np.ndarray:
    """``raw`` ``[N, bytes per row]`` as ``[N, blocks, block bytes]``."""
    size = BLOCK_BYTES[kind]
    if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[1] % size:
        raise ValueError(f"{kind} data must be uint8 [rows, {size} * blocks], got {raw.dtype} {raw.shape}")
    return np.ascontiguousarray(raw).reshape(raw.shape[0], raw.shape[1] // size, size)


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte ``at`` of every block, as float32 ``[N, blocks]`` (GGML_FP16_TO_FP32)."""
    return blocks[..., at : at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``[..., n]`` bytes -> ``[..., 2n]``: the low nibbles, then the high ones."""
    return np.concatenate((qs & 0x0F, qs >> 4), axis=-1)


def _bits(qh: np.ndarray, count: int) -> np.ndarray:
    """``[..., count / 8]`` little-endian bit fields -> ``[..., count]`` values 0/1, bit i at i."""
    return np.unpackbits(qh, axis=-1, count=count, bitorder="little")


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 mins per super-block (get_scale_min_k4)."""
    s = scales.astype(np.uint8)
    low, mid, high = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate((low & 63, (high & 0x0F) | ((low >> 6) << 4)), axis=-1)
    m = np.concatenate((mid & 63, (high >> 4) | ((mid >> 6) << 4)), axis=-1)
    return sc, m


def _q4_k_parts(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K: (q ``[N, blocks, 8, 32]`` in 0..15, ``d·sc``, ``dmin·m`` ``[N, blocks, 8]``), all exact."""
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, m = _k_scales(blocks[..., 4:16])
    qs = blocks[..., 16:144].reshape(*blocks.shape[:2], 4, 1, 32)  # 4 chunks of 64 weights
    q = np.concatenate((qs & 0x0F, qs >> 4), axis=-2).reshape(*blocks.shape[:2], 8, 32)
    return q, d[..., None] * sc, dmin[..., None] * m


def _q5_k_parts(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q5_K: as Q4_K, q in 0..31: sub-block s takes bit s of each of the 32 ``qh`` bytes."""
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, m = _k_scales(blocks[..., 4:16])
    qh = blocks[..., 16:48]  # [N, blocks, 32]
    high = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [N, blocks, 8, 32]
    qs = blocks[..., 48:176].reshape(*blocks.shape[:2], 4, 1, 32)
    low = np.concatenate((qs & 0x0F, qs >> 4), axis=-2).reshape(*blocks.shape[:2], 8, 32)
    return low | (high << 4), d[..., None] * sc, dmin[..., None] * m


def _q6_k_values(blocks: np.ndarray) -> np.ndarray:
    """Q6_K: ``d · sc · (q − 32)`` over 16 sub-blocks of 16, rounded as ggml rounds it."""
    ql = blocks[..., 0:128].reshape(*blocks.shape[:2], 2, 2, 32)  # [half, ql[0:32] / ql[32:64], l]
    qh = blocks[..., 128:192].reshape(*blocks.shape[:2], 2, 1, 32)  # [half, -, l]
    sc = blocks[..., 192:208].copy().view(np.int8).reshape(*blocks.shape[:2], 2, 8, 1)
    d = _f16(blocks, 208)
    # quarter k of a half: the low (k < 2) or high nibbles of ql[32 (k % 2) + l], with bits 2k, 2k+1 of qh[l]
    low = np.concatenate((ql & 0x0F, ql >> 4), axis=-2)  # [N, blocks, 2, 4, 32]
    high = (qh >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3
    q = (low | (high << 4)).astype(np.int8) - 32  # [N, blocks, half, quarter, 32]
    scale = d[..., None, None, None] * sc.astype(np.float32)  # [N, blocks, 2, 8, 1]: one per 16 weights
    return scale * q.reshape(*blocks.shape[:2], 2, 8, 16).astype(np.float32)


def dequantize(raw: np.ndarray, kind: str) -> torch.Tensor:
    """``[N, bytes per row]`` of ``kind`` blocks -> float32 ``[N, K]``, bit-equal to ggml's
    ``dequantize_row_*`` (each float32 product and sum in its order)."""
    blocks = _blocks(raw, kind)
    rows = blocks.shape[0]
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        d = _f16(blocks, 0)[..., None]
        offset = 4 if kind.endswith("_1") else 2
        if kind.startswith("Q5"):
            high = _bits(blocks[..., offset : offset + 4], QK)  # weight i's fifth bit is bit i of qh
            q = _nibbles(blocks[..., offset + 4 :]) | (high << 4)
        else:
            q = _nibbles(blocks[..., offset:])
        if kind.endswith("_1"):
            values = q.astype(np.float32) * d + _f16(blocks, 2)[..., None]  # x·d + m
        else:
            values = (q.astype(np.int8) - (16 if kind == "Q5_0" else 8)).astype(np.float32) * d  # (x − 8|16)·d
    elif kind == "Q8_0":
        values = blocks[..., 2:].copy().view(np.int8).astype(np.float32) * _f16(blocks, 0)[..., None]
    elif kind in ("Q4_K", "Q5_K"):
        q, scale, low = (_q4_k_parts if kind == "Q4_K" else _q5_k_parts)(blocks)
        values = scale[..., None] * q.astype(np.float32) - low[..., None]  # d1·q − m1
    elif kind == "Q6_K":
        values = _q6_k_values(blocks)
    else:
        raise ValueError(f"no dequantizer for GGUF type {kind}")
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(rows, -1))


def unpack(raw: np.ndarray, kind: str, chunk_rows: int = 4096) -> QuantizedWeight:
    """``kind`` rows in the format ``KEPT[kind]`` names. Int4 takes the 4-bit values as they
    are; int8 requantizes ``chunk_rows`` rows of float values at a time."""
    if KEPT.get(kind) == INT4:
        return _unpack_int4(_blocks(raw, kind), kind)
    if KEPT.get(kind) != INT8:
        raise ValueError(f"GGUF type {kind} is not kept quantized")
    starts = range(0, len(raw), chunk_rows)
    parts = [quantize_int8(dequantize(raw[start : start + chunk_rows], kind)) for start in starts]
    return Int8Channels(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]))


def _unpack_int4(blocks: np.ndarray, kind: str) -> Int4Groups:
    rows = blocks.shape[0]
    if kind == "Q4_K":
        q, scale, low = _q4_k_parts(blocks)
        zero = 8 * scale - low  # d1·q − m1 == (q − 8)·d1 + (8·d1 − m1)
    else:
        scale = _f16(blocks, 0)
        q = _nibbles(blocks[..., 4:] if kind == "Q4_1" else blocks[..., 2:])
        # Q4_1: x·d + m == (x − 8)·d + (m + 8·d); Q4_0: (x − 8)·d
        zero = _f16(blocks, 2) + 8 * scale if kind == "Q4_1" else np.zeros_like(scale)
    q = np.ascontiguousarray(q).reshape(rows, -1)
    scale, zero = (torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32).reshape(rows, -1)) for a in (scale, zero))
    return Int4Groups(torch.from_numpy(q), scale, zero, QK)
