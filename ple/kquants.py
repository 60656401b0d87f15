"""Quantizers to GGUF's Q4_K, Q5_K and Q6_K blocks, which the gguf package
cannot write (it decodes them only): float32 values to block bytes that
``gguf.quants.dequantize`` reads back, in NumPy.

A plain search, not llama.cpp's iterative one: each sub-block's scale (and,
for Q4_K and Q5_K, its minimum) covers the sub-block's range exactly, the
sub-block scales are quantized to 6 bits (Q6_K: 8) of the block's f16 scale
rounded up, so that no value falls outside the quants, and every value takes
its nearest quant.  The error of a value is then at most half its sub-block's
step plus, for Q4_K and Q5_K, one step of the block's minimum scale
(``docs/tables.md``; ``tests/test_quantize_table.py`` checks the bound).

``quantize_k(values, name)``: ``values`` float32 ``[..., n * 256]``, finite;
returns uint8 ``[..., n * block_bytes]``.
"""

from __future__ import annotations

import numpy as np

QK_K = 256
# Bytes per block (gguf.GGML_QUANT_SIZES).
BLOCK_BYTES = {"q4_k": 144, "q5_k": 176, "q6_k": 210}


def _f16_at_least(target: np.ndarray) -> np.ndarray:
    """The f16 nearest ``target`` (float32, >= 0, at most the largest f16),
    or the next larger f16 where that is below ``target``: a block scale
    from which every sub-block scale is reached without exceeding its bits."""
    rounded = target.astype(np.float16)
    return np.where(rounded.astype(np.float32) < target,
                    np.nextafter(rounded, np.float16(np.inf)), rounded)


def _ratio(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    """``numerator / denominator``, 0 where the denominator is 0."""
    safe = np.where(denominator == 0, 1, denominator)
    return np.where(denominator == 0, 0, numerator / safe)


def _scales(step: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """For sub-block steps ``step`` ``[blocks, sub-blocks]`` (>= 0): the
    block's f16 scale ``d`` ``[blocks, 1]`` and each sub-block's integer
    scale (0..``levels``), with ``d * scale >= step``."""
    d = _f16_at_least(step.max(axis=1, keepdims=True) / np.float32(levels))
    scale = np.ceil(_ratio(step, d.astype(np.float32))).clip(0, levels)
    return d, scale.astype(np.int32)


def _pack_6bit(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """The 12 bytes of Q4_K's and Q5_K's eight 6-bit scales and minimums
    ``[blocks, 8]``: bytes 0-3 hold scales 0-3 and the top 2 bits of scales
    4-7, bytes 4-7 the minimums likewise, bytes 8-11 the low 4 bits of
    scale and minimum 4-7."""
    low, high = slice(0, 4), slice(4, 8)
    return np.concatenate([
        sc[:, low] | ((sc[:, high] >> 4) << 6),
        m[:, low] | ((m[:, high] >> 4) << 6),
        (sc[:, high] & 15) | ((m[:, high] & 15) << 4),
    ], axis=1).astype(np.uint8)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """The low 4 bits of quants ``[blocks, 256]`` as 128 bytes: sub-blocks
    2g and 2g + 1 in the low and high nibbles of bytes 32g..32g+31."""
    pairs = (q & 15).reshape(-1, 4, 2, 32)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128).astype(np.uint8)


def _f16_bytes(d: np.ndarray) -> np.ndarray:
    return d.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _quantize_with_min(blocks: np.ndarray, bits: int) -> np.ndarray:
    """Q4_K (4 bits) or Q5_K (5 bits): a value is ``(d * sc) * q - (dmin * m)``,
    q in [0, 2^bits), per sub-block of 32 a 6-bit sc and m."""
    top = (1 << bits) - 1
    sub = blocks.reshape(-1, 8, 32)
    low = np.minimum(sub.min(axis=2), 0)
    d, sc = _scales((sub.max(axis=2) - low) / np.float32(top), 63)
    dmin, m = _scales(-low, 63)
    # The decoder's float32 arithmetic, for the quants to be nearest its values.
    step = d.astype(np.float32) * sc.astype(np.float32)
    offset = dmin.astype(np.float32) * m.astype(np.float32)
    q = np.rint(_ratio(sub + offset[:, :, None], step[:, :, None])).clip(0, top).astype(np.int32)
    q = q.reshape(-1, QK_K)
    parts = [_f16_bytes(d), _f16_bytes(dmin), _pack_6bit(sc, m)]
    if bits == 5:
        fifth = (q >> 4).reshape(-1, 8, 32)  # bit s of byte l: value 32s + l
        parts.append((fifth << np.arange(8).reshape(1, 8, 1)).sum(axis=1).astype(np.uint8))
    parts.append(_pack_nibbles(q))
    return np.concatenate(parts, axis=1)


def _quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """Q6_K: a value is ``(d * sc) * q``, q in [-32, 31], per sub-block of 16
    an int8 sc (here 0..127)."""
    sub = blocks.reshape(-1, 16, 16)
    d, sc = _scales(np.abs(sub).max(axis=2) / np.float32(31), 127)
    step = d.astype(np.float32) * sc.astype(np.float32)
    q = np.rint(_ratio(sub, step[:, :, None])).clip(-32, 31).astype(np.int32) + 32
    q = q.reshape(-1, 2, 128)  # the two halves of 128 values
    # ql: bytes 64h + j hold values 128h + j (low nibble) and 128h + 64 + j (high).
    ql = (q[:, :, :64] & 15) | ((q[:, :, 64:] & 15) << 4)
    # qh: bytes 32h + l hold the top 2 bits of values 128h + 32t + l at bit pair t.
    top = (q >> 4).reshape(-1, 2, 4, 32)
    qh = (top << (2 * np.arange(4)).reshape(1, 1, 4, 1)).sum(axis=2)
    return np.concatenate([ql.reshape(-1, 128).astype(np.uint8),
                           qh.reshape(-1, 64).astype(np.uint8),
                           sc.astype(np.int8).view(np.uint8), _f16_bytes(d)], axis=1)


def quantize_k(values: np.ndarray, name: str) -> np.ndarray:
    """``values`` (float32 ``[..., n * 256]``, finite) as ``name`` ("q4_k",
    "q5_k" or "q6_k") blocks: uint8 ``[..., n * block_bytes]``."""
    if name not in BLOCK_BYTES:
        raise ValueError(f"ple's quantizers write {', '.join(BLOCK_BYTES)}, not {name!r}")
    if values.shape[-1] % QK_K:
        raise ValueError(f"rows of {values.shape[-1]} values are not whole {name} blocks of {QK_K}")
    blocks = np.ascontiguousarray(values, dtype=np.float32).reshape(-1, QK_K)
    if name == "q6_k":
        packed = _quantize_q6_k(blocks)
    else:
        packed = _quantize_with_min(blocks, 4 if name == "q4_k" else 5)
    return packed.reshape(*values.shape[:-1], values.shape[-1] // QK_K * BLOCK_BYTES[name])
