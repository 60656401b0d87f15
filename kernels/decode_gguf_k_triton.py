"""The GPU decoder of GGUF super-blocks of 256 values without grids: Q2_K,
Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS (sub-block scales), TQ1_0 and TQ2_0
(ternary), in one Triton kernel specialized by ``FMT``
(kernels/decode_gguf_triton.py's ``decode_blocks_triton`` launches it;
kernels/gguf_bits_triton.py says what the decoders share and why they are
bit-identical to ``gguf.quants.dequantize``).

Each value is a sub-block scale times a quant, less a sub-block minimum for
Q2_K, Q4_K and Q5_K; a ternary value is the block's f16 scale times -1, 0
or 1.  The products are exact in float32 (at most 24 significant bits: an
f16 scale's 11, a 4- to 8-bit sub-block scale and a 2- to 7-bit quant), so
the only float32 rounding is the subtraction of the minimum, which the
launches keep from fusing into an FMA.

Only imported where triton is available.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ple.formats import RowFormat
from ple.kernels.decode_triton import launch_decoder
from ple.kernels.gguf_bits_triton import (IQ4_NL_HI, IQ4_NL_LO, LAUNCH_OPTIONS, f16_at, level16,
                                          store_values, u8_at)
from ple.kernels.tier_rows_triton import TierRead, call_row


@triton.jit
def k_scale_min(blk, s, mask):
    """Q4_K's and Q5_K's 6-bit scale and minimum of sub-block ``s`` (of 32
    values) from the 12 bytes at ``blk + 4``: bytes 0-3 hold the scales of
    sub-blocks 0-3 and the top bits of those of 4-7, bytes 4-7 the minimums
    likewise, bytes 8-11 the low 4 bits of the scale and minimum of 4-7."""
    j = s % 4
    a = u8_at(blk + 4 + j, mask)
    c = u8_at(blk + 8 + j, mask)
    e = u8_at(blk + 12 + j, mask)
    sc = tl.where(s < 4, a & 63, (e & 15) | ((a >> 6) << 4))
    m = tl.where(s < 4, c & 63, (e >> 4) | ((c >> 6) << 4))
    return sc, m


@triton.jit
def decode_k_blocks_kernel(
    rows_ptr,  # *u8 [n, row_bytes]: the staged rows (device memory, or pinned host memory: UVA)
    status_ptr,  # *i32, one word: nonzero when the call failed (HAS_STATUS)
    out_ptr,  # *fp32 | *fp16 | *bf16 [n, cols]; its element type is the output dtype (compile-time)
    cols,
    row_bytes,
    # Where each row lies with tiers: tier_rows_triton.call_row.
    ids_ptr, device_ptr, host_ptr, first_row, device_rows, tier_rows, num_rows, hits_ptr,
    report_ptr,
    FMT: tl.constexpr,  # RowFormat.name of one of K_FORMAT_NAMES
    BLOCK: tl.constexpr,
    TIERS: tl.constexpr,
    HAS_STATUS: tl.constexpr,
    SCAN_IDS: tl.constexpr,
    BB: tl.constexpr,  # bytes per block (RowFormat.block_bytes)
):
    src, failed = call_row(rows_ptr, status_ptr, row_bytes, ids_ptr, device_ptr, host_ptr,
                           first_row, device_rows, tier_rows, num_rows, hits_ptr, report_ptr, TIERS,
                           HAS_STATUS, SCAN_IDS)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    # A failed call reads nothing (decode_triton.py says why, and why a bound).
    mask = offs < tl.where(failed, 0, cols)
    blk = src + (offs // 256) * BB  # this lane's super-block
    k = offs % 256  # this lane's value within it
    s = k // 32  # its sub-block of 32 values
    # Several types pack 2-bit quants as Q2_K does: bytes 32h..32h+31 of
    # the quants hold values 128h + l (bits 0-1), 128h + 32 + l (bits 2-3), ...
    crumb_at = (k // 128) * 32 + k % 32
    crumb_shift = ((k // 32) % 4) * 2

    if FMT == "q2_k":
        # 16 bytes of 4-bit scale | 4-bit minimum (one per 16 values), 64 bytes
        # of 2-bit quants, d and dmin: f16.  gguf: (d * sc) * q - (dmin * m).
        sm = u8_at(blk + k // 16, mask)
        q = (u8_at(blk + 16 + crumb_at, mask) >> crumb_shift) & 3
        dl = f16_at(blk + 80, mask) * (sm & 15).to(tl.float32)
        ml = f16_at(blk + 82, mask) * (sm >> 4).to(tl.float32)
        v = dl * q.to(tl.float32) - ml
    elif FMT == "q3_k":
        # 32 bytes hmask (bit s of byte l: the third bit of value 32s + l, set
        # for q >= 0), 64 bytes of 2-bit quants, 12 bytes of 6-bit scales (the
        # low 4 bits of scale i in byte i % 8, nibble i // 8; the top 2 bits in
        # byte 8 + i % 4, bit pair i // 4), d: f16.  gguf: (d * (sc - 32)) * q.
        i = k // 16
        low = (u8_at(blk + 96 + i % 8, mask) >> ((i // 8) * 4)) & 15
        top = (u8_at(blk + 104 + i % 4, mask) >> ((i // 4) * 2)) & 3
        sc = (low | (top << 4)) - 32
        high = (u8_at(blk + k % 32, mask) >> s) & 1
        q = ((u8_at(blk + 32 + crumb_at, mask) >> crumb_shift) & 3) - ((high ^ 1) << 2)
        v = (f16_at(blk + 108, mask) * sc.to(tl.float32)) * q.to(tl.float32)
    elif FMT == "q4_k" or FMT == "q5_k":
        # d, dmin: f16; 12 bytes of 6-bit scales and minimums (k_scale_min);
        # Q5_K: 32 bytes whose bit s of byte l is the fifth bit of value 32s + l;
        # 128 bytes of nibbles, sub-blocks 2g and 2g+1 in the low and high
        # nibbles of bytes 32g..32g+31.  gguf: (d * sc) * q - (dmin * m).
        sc, m = k_scale_min(blk, s, mask)
        if FMT == "q4_k":
            QS: tl.constexpr = 16
        else:
            QS: tl.constexpr = 48
        q = (u8_at(blk + QS + (s // 2) * 32 + k % 32, mask) >> ((s % 2) * 4)) & 15
        if FMT == "q5_k":
            q = q | (((u8_at(blk + 16 + k % 32, mask) >> s) & 1) << 4)
        dl = f16_at(blk, mask) * sc.to(tl.float32)
        ml = f16_at(blk + 2, mask) * m.to(tl.float32)
        v = dl * q.to(tl.float32) - ml
    elif FMT == "q6_k":
        # 128 bytes ql, 64 bytes qh, 16 int8 scales (one per 16 values), f16 d.
        # Value k of each half h = k // 128: low 4 bits from ql[64h + k % 64] (low
        # nibble for k % 128 < 64), high 2 bits from qh[32h + k % 32], bit pair
        # (k % 128) // 32.  gguf: (d * sc) * q.
        h = k // 128
        lo = (u8_at(blk + h * 64 + k % 64, mask) >> (((k // 64) % 2) * 4)) & 15
        hi = (u8_at(blk + 128 + h * 32 + k % 32, mask) >> (((k // 32) % 4) * 2)) & 3
        sc = tl.load((blk + 192 + k // 16).to(tl.pointer_type(tl.int8)), mask=mask)
        q = (lo | (hi << 4)) - 32
        v = (f16_at(blk + 208, mask) * sc.to(tl.float32)) * q.to(tl.float32)
    elif FMT == "tq2_0":
        # 64 bytes of 2-bit quants (Q2_K's order), then d: f16.  gguf: d * (q - 1).
        q = ((u8_at(blk + crumb_at, mask) >> crumb_shift) & 3) - 1
        v = f16_at(blk + 64, mask) * q.to(tl.float32)
    elif FMT == "tq1_0":
        # 48 bytes, then 4 bytes qh, then d: f16.  Each byte packs 5 (qh: 4)
        # base-3 digits as a fixed-point fraction of 256: value p of byte b is
        # ((b * 3^p mod 256) * 3) >> 8.  Bytes 0-31 hold values 32p + b (p < 5),
        # bytes 32-47 values 160 + 16p + (b - 32), qh values 240 + 4p + b.
        # gguf: d * (digit - 1).
        at = tl.where(k < 160, k % 32, tl.where(k < 240, 32 + (k - 160) % 16, 48 + (k - 240) % 4))
        p = tl.where(k < 160, k // 32, tl.where(k < 240, (k - 160) // 16, (k - 240) // 4))
        power = tl.where(p < 2, 1 + 2 * p, tl.where(p == 2, 9, tl.where(p == 3, 27, 81)))  # 3^p
        digit = (((u8_at(blk + at, mask) * power) & 255) * 3) >> 8
        v = f16_at(blk + 52, mask) * (digit - 1).to(tl.float32)
    else:  # "iq4_xs"
        # d: f16; 2 bytes of the top 2 bits of the 8 sub-block scales (bit
        # pair s % 4 of byte s // 4); 4 bytes of their low 4 bits (nibble s % 2
        # of byte s // 2); 16 bytes per sub-block of IQ4_NL level indices,
        # values 0..15 in the low nibbles, 16..31 in the high.
        # gguf: (d * (sc - 32)) * level.
        low = (u8_at(blk + 4 + s // 2, mask) >> ((s % 2) * 4)) & 15
        top = (u8_at(blk + 2 + s // 4, mask) >> ((s % 4) * 2)) & 3
        sc = (low | (top << 4)) - 32
        nib = (u8_at(blk + 8 + s * 16 + k % 16, mask) >> (((k % 32) // 16) * 4)) & 15
        dl = f16_at(blk, mask) * sc.to(tl.float32)
        v = dl * level16(nib, IQ4_NL_LO, IQ4_NL_HI).to(tl.float32)

    store_values(out_ptr, row, cols, offs, v, failed, BLOCK)


K_FORMAT_NAMES = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs", "tq1_0", "tq2_0")


def decode_k_blocks_triton(staged: torch.Tensor | None, fmt: RowFormat, scale: float,
                           out: torch.Tensor, status: torch.Tensor | None = None,
                           tiers: TierRead | None = None) -> torch.Tensor:
    """``decode_blocks_triton`` of a format in K_FORMAT_NAMES."""
    if fmt.name not in K_FORMAT_NAMES:
        raise ValueError(f"no Triton super-block decoder for row format {fmt.name!r}")
    return launch_decoder(decode_k_blocks_kernel, staged, fmt, out, status, tiers,
                          BB=fmt.block_bytes, **LAUNCH_OPTIONS)
