"""The GPU decoder of GGUF block rows: staged rows to values, with one Triton
kernel per family of block types.

``decode_blocks_triton`` launches the family's kernel of a row format: this
file's kernel decodes the small blocks of 32 or 64 values with one or two
scales (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4, NVFP4);
kernels/decode_gguf_k_triton.py the super-blocks of 256 values without
grids (the K-quants, IQ4_XS, TQ1_0, TQ2_0); kernels/decode_gguf_iq_triton.py
those with grids (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S).
What they share, and why they are bit-identical to
``gguf.quants.dequantize`` followed by torch's cast, is in
kernels/gguf_bits_triton.py.  Block layouts: gguf/quants.py (each kernel's
comments say where a lane finds its value's bits and scales).

Every product here is exact in float32: the significant bits of its factors
add up to at most 18 (an f16 scale's 11, or NVFP4's E4M3 scale's 4, and a
quant's at most 7), and MXFP4's scale is a power of two (whose products may
overflow to infinity, as gguf's do).  So the only float32 roundings are
Q4_1's and Q5_1's final sums.

Each row is read from the staged rows or, with tiers, where it lies, as in
kernels/decode_triton.py (kernels/tier_rows_triton.py's ``call_row``).

Only imported where triton is available.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ple.formats import RowFormat
from ple.kernels.decode_gguf_iq_triton import IQ_FORMAT_NAMES, decode_iq_blocks_triton
from ple.kernels.decode_gguf_k_triton import K_FORMAT_NAMES, decode_k_blocks_triton
from ple.kernels.decode_triton import launch_decoder
from ple.kernels.gguf_bits_triton import (E2M1_HI, E2M1_LO, IQ4_NL_HI, IQ4_NL_LO, LAUNCH_OPTIONS,
                                          f16_at, level16, store_values, u8_at)
from ple.kernels.tier_rows_triton import TierRead, call_row


@triton.jit
def e8m0_half(e):
    """MXFP4's scale byte ``e`` (int32) as float32: 2^(e - 128), as
    gguf.quants.MXFP4.e8m0_to_fp32_half builds its bits."""
    bits = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.to(tl.uint32).to(tl.float32, bitcast=True)


@triton.jit
def ue4m3_half(x):
    """NVFP4's scale byte ``x`` (int32) as float32, as
    gguf.quants.NVFP4.ue4m3_to_fp32 computes it: unsigned E4M3 (the top bit
    ignored) times 0.5, and 0 for the bytes 0x00 and 0x7F.  Exact: a normal
    value is (1 + m/8) * 2^(e - 8), a subnormal one m * 2^-10."""
    exp = (x >> 3) & 15
    man = x & 7
    normal = (((exp + 119) << 23) | (man << 20)).to(tl.uint32).to(tl.float32, bitcast=True)
    value = tl.where(exp == 0, man.to(tl.float32) * 0.0009765625, normal)
    return tl.where((x == 0) | (x == 0x7F), 0.0, value)


@triton.jit
def decode_blocks_kernel(
    rows_ptr,  # *u8 [n, row_bytes]: the staged rows (device memory, or pinned host memory: UVA)
    status_ptr,  # *i32, one word: nonzero when the call failed (HAS_STATUS)
    out_ptr,  # *fp32 | *fp16 | *bf16 [n, cols]; its element type is the output dtype (compile-time)
    cols,
    row_bytes,
    # Where each row lies with tiers: tier_rows_triton.call_row.
    ids_ptr, device_ptr, host_ptr, first_row, device_rows, tier_rows, num_rows, hits_ptr,
    report_ptr,
    FMT: tl.constexpr,  # RowFormat.name of one of FORMAT_NAMES
    BLOCK: tl.constexpr,
    TIERS: tl.constexpr,
    HAS_STATUS: tl.constexpr,
    SCAN_IDS: tl.constexpr,
    QK: tl.constexpr,  # values per block (RowFormat.block_size)
    BB: tl.constexpr,  # bytes per block (RowFormat.block_bytes)
):
    # Grid: (rows, column blocks).  Row offsets in int64 (call_row): row *
    # row_bytes and row * cols pass 2^31 on large tables.  Within a row int32
    # is enough.
    src, failed = call_row(rows_ptr, status_ptr, row_bytes, ids_ptr, device_ptr, host_ptr,
                           first_row, device_rows, tier_rows, num_rows, hits_ptr, report_ptr, TIERS,
                           HAS_STATUS, SCAN_IDS)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    # A failed call reads nothing (decode_triton.py says why, and why a bound).
    mask = offs < tl.where(failed, 0, cols)
    blk = src + (offs // QK) * BB  # this lane's block
    k = offs % QK  # this lane's value within its block

    if FMT == "q8_0":
        # d: f16, then 32 int8.  gguf: q * d.
        q = tl.load((blk + 2 + k).to(tl.pointer_type(tl.int8)), mask=mask).to(tl.float32)
        v = q * f16_at(blk, mask)
    elif FMT == "nvfp4":
        # 4 scale bytes (unsigned E4M3), one per 16 values; then 8 bytes per 16
        # values: values 0..7 in the low nibbles, 8..15 in the high.
        j = k % 16
        nib = (u8_at(blk + 4 + (k // 16) * 8 + j % 8, mask) >> ((j // 8) * 4)) & 15
        v = ue4m3_half(u8_at(blk + k // 16, mask)) * level16(nib, E2M1_LO, E2M1_HI).to(tl.float32)
    else:
        # The others: their scales, then (Q5_0, Q5_1) the fifth bits of the 32
        # values as a little-endian uint32, then 16 bytes: values 0..15 in the
        # low nibbles, 16..31 in the high.
        if FMT == "mxfp4":
            QS: tl.constexpr = 1  # e: one byte
        elif FMT == "q4_1":
            QS: tl.constexpr = 4  # d, m: f16
        elif FMT == "q5_0":
            QS: tl.constexpr = 6  # d: f16; qh
        elif FMT == "q5_1":
            QS: tl.constexpr = 8  # d, m: f16; qh
        else:  # "q4_0", "iq4_nl"
            QS: tl.constexpr = 2  # d: f16
        nib = (u8_at(blk + QS + k % 16, mask) >> ((k // 16) * 4)) & 15
        if FMT == "mxfp4":
            v = e8m0_half(u8_at(blk, mask)) * level16(nib, E2M1_LO, E2M1_HI).to(tl.float32)
        elif FMT == "iq4_nl":
            v = f16_at(blk, mask) * level16(nib, IQ4_NL_LO, IQ4_NL_HI).to(tl.float32)
        elif FMT == "q4_0":
            v = f16_at(blk, mask) * (nib - 8).to(tl.float32)
        elif FMT == "q4_1":
            # gguf: (d * q) + m.
            v = f16_at(blk, mask) * nib.to(tl.float32) + f16_at(blk + 2, mask)
        else:  # "q5_0", "q5_1"
            high = (u8_at(blk + QS - 4 + k // 8, mask) >> (k % 8)) & 1
            q = nib | (high << 4)
            if FMT == "q5_0":
                v = f16_at(blk, mask) * (q - 16).to(tl.float32)
            else:
                v = f16_at(blk, mask) * q.to(tl.float32) + f16_at(blk + 2, mask)

    store_values(out_ptr, row, cols, offs, v, failed, BLOCK)


FORMAT_NAMES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "iq4_nl", "mxfp4", "nvfp4")


def decode_blocks_triton(staged: torch.Tensor | None, fmt: RowFormat, scale: float,
                         out: torch.Tensor, status: torch.Tensor | None = None,
                         tiers: TierRead | None = None) -> torch.Tensor:
    """Decode staged row ``i`` of GGUF blocks (uint8 ``[n, row_bytes]``,
    contiguous) into ``out[i]`` (``[n, cols]`` float32/float16/bfloat16,
    contiguous); returns ``out``.  The signature of ``decode_rows_triton``;
    ``scale`` is unused (block formats carry their own scales).
    ``status``: an int32 word; when it is nonzero at run time every value is NaN.
    ``tiers``: read each row where it lies instead (``launch_decoder``)."""
    if fmt.name in K_FORMAT_NAMES:
        return decode_k_blocks_triton(staged, fmt, scale, out, status, tiers)
    if fmt.name in IQ_FORMAT_NAMES:
        return decode_iq_blocks_triton(staged, fmt, scale, out, status, tiers)
    if fmt.name not in FORMAT_NAMES:
        raise ValueError(f"no Triton block decoder for row format {fmt.name!r}")
    return launch_decoder(decode_blocks_kernel, staged, fmt, out, status, tiers, QK=fmt.block_size,
                          BB=fmt.block_bytes, **LAUNCH_OPTIONS)
