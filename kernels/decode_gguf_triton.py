"""The GPU decoder of GGUF block rows: Q8_0, Q4_0, IQ4_NL, Q4_K and Q6_K staged
rows to values, in one Triton kernel.

Bit-identical to the CPU decoder (kernels/decode.py, which runs
``gguf.quants.dequantize`` and then torch's cast): every value is computed in
float32 with the same operations in the same order as gguf does them, then cast
to the output dtype as kernels/decode_triton.py casts (round to nearest even).
Like that kernel this one runs on V100 (SM70) and Turing (SM75): the f16 block
scales are widened with the f16 -> f32 conversion (exact, and present on every
target), bf16 is rounded with integer operations (decode_triton's helper), and
nothing else needs a newer instruction.

Every product here is even exact in float32: the significant bits of the
factors add up to at most 24 (an f16 scale's 11, plus 7 for the quants of Q8_0,
Q4_0 and IQ4_NL, 6 + 4 for Q4_K's sub-block scale and quant, 7 + 5 for Q6_K's),
so the only float32 rounding is Q4_K's final subtraction and the order of the
products does not matter.  The launches still disable FP fusion, so that no FMA
changes gguf's operations even where that argument would not hold.

Each row is read from the staged rows or, with tiers, where it lies, as in
kernels/decode_triton.py (kernels/tier_rows_triton.py's ``call_row``).

One kernel for the five formats, specialized by ``FMT``: they share everything
but the few lines that find a value's bits and scale in its block (block
layouts: `docs/design.md`, "Formats", and gguf/quants.py).  Each program decodes
``BLOCK`` consecutive values of one row, one per lane; a lane reads the bytes
of its own value and of its block's scales (lanes of one block read the same
scale bytes, which the caches serve).

Only imported where triton is available.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ple.formats import BLOCK_FORMATS, RowFormat
from ple.kernels.decode_triton import f32_to_bf16_rne, launch_decoder
from ple.kernels.tier_rows_triton import TierRead, call_row

# IQ4_NL's 16 non-linear levels (gguf.quants.IQ4_NL.kvalues), as int8 bytes packed
# little-endian into two int64 words, levels 0-7 and 8-15: a lane picks its level
# with a select and a shift instead of a table in memory.
IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _pack_int8(values) -> int:
    return int.from_bytes(bytes(v & 0xFF for v in values), "little", signed=True)


IQ4_NL_LO: tl.constexpr = tl.constexpr(_pack_int8(IQ4_NL_VALUES[:8]))
IQ4_NL_HI: tl.constexpr = tl.constexpr(_pack_int8(IQ4_NL_VALUES[8:]))

# Compile options of every launch.  No FP fusion: gguf (numpy) rounds each
# product and difference on its own, an FMA does not (the products being exact,
# it would make no difference today; see the module's docstring).
LAUNCH_OPTIONS = {"enable_fp_fusion": False}


@triton.jit
def f16_at(ptr, mask):
    """The little-endian f16 at byte address ``ptr`` (any alignment), as float32."""
    lo = tl.load(ptr, mask=mask).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask).to(tl.uint16)
    # f16 -> f32 is exact (subnormals too) and is cvt.f32.f16 on every target,
    # the conversion decode_triton.py uses for f16 rows.
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def u8_at(ptr, mask):
    return tl.load(ptr, mask=mask).to(tl.int32)


@triton.jit
def iq4_nl_level(nib):
    """IQ4_NL_VALUES[nib] for int32 nibbles 0..15."""
    word = tl.where(nib < 8, IQ4_NL_LO, IQ4_NL_HI)
    byte = ((word >> ((nib & 7) * 8)) & 0xFF).to(tl.int32)
    return (byte ^ 0x80) - 0x80  # sign-extend the int8


@triton.jit
def decode_blocks_kernel(
    rows_ptr,  # *u8 [n, row_bytes]: the staged rows; device memory, or pinned host memory read over UVA
    status_ptr,  # *i32, one word: nonzero when the call failed (HAS_STATUS)
    out_ptr,  # *fp32 | *fp16 | *bf16 [n, cols]; its element type is the output dtype (compile-time)
    cols,
    row_bytes,
    # Where each row lies with tiers: tier_rows_triton.call_row.
    ids_ptr, device_ptr, host_ptr, first_row, device_rows, tier_rows, num_rows, hits_ptr, report_ptr,
    FMT: tl.constexpr,  # RowFormat.name of a block format
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
    src, failed = call_row(rows_ptr, status_ptr, row_bytes, ids_ptr, device_ptr, host_ptr, first_row,
                           device_rows, tier_rows, num_rows, hits_ptr, report_ptr, TIERS, HAS_STATUS,
                           SCAN_IDS)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = offs < cols
    # A failed call reads nothing (decode_triton.py says why, and why a bound).
    mask = offs < tl.where(failed, 0, cols)
    OUT: tl.constexpr = out_ptr.dtype.element_ty
    blk = src + (offs // QK) * BB  # this lane's block
    k = offs % QK  # this lane's value within its block

    if FMT == "q8_0":
        # d: f16, then 32 int8.  gguf: q * d.
        q = tl.load((blk + 2 + k).to(tl.pointer_type(tl.int8)), mask=mask).to(tl.float32)
        v = q * f16_at(blk, mask)
    elif FMT == "q4_0" or FMT == "iq4_nl":
        # d: f16, then 16 bytes: values 0..15 in the low nibbles, 16..31 in the high.
        nib = (u8_at(blk + 2 + k % 16, mask) >> ((k // 16) * 4)) & 15
        if FMT == "q4_0":
            q = nib - 8
        else:
            q = iq4_nl_level(nib)
        v = f16_at(blk, mask) * q.to(tl.float32)  # gguf: d * q
    elif FMT == "q4_k":
        # d, dmin: f16; 12 bytes of 6-bit scales and mins of the 8 sub-blocks of 32
        # values; 128 bytes of nibbles, sub-blocks 2g and 2g+1 in the low and high
        # nibbles of bytes 32g..32g+31.
        s = k // 32
        j = s % 4
        a = u8_at(blk + 4 + j, mask)  # scale of sub-block j (6 bits) | 2 high bits of scale j+4
        c = u8_at(blk + 8 + j, mask)  # min of sub-block j (6 bits) | 2 high bits of min j+4
        e = u8_at(blk + 12 + j, mask)  # low 4 bits of scale j+4 | low 4 bits of min j+4
        sc = tl.where(s < 4, a & 63, (e & 15) | ((a >> 6) << 4))
        m = tl.where(s < 4, c & 63, (e >> 4) | ((c >> 6) << 4))
        q = (u8_at(blk + 16 + (s // 2) * 32 + k % 32, mask) >> ((s % 2) * 4)) & 15
        # gguf: (d * sc) * q - (dmin * m), each operation in float32.
        dl = f16_at(blk, mask) * sc.to(tl.float32)
        ml = f16_at(blk + 2, mask) * m.to(tl.float32)
        v = dl * q.to(tl.float32) - ml
    else:  # "q6_k"
        # 128 bytes ql, 64 bytes qh, 16 int8 scales (one per 16 values), f16 d.
        # Value k of each half h = k // 128: low 4 bits from ql[64h + k % 64] (low
        # nibble for k % 128 < 64), high 2 bits from qh[32h + k % 32], bit pair
        # (k % 128) // 32.
        h = k // 128
        lo = (u8_at(blk + h * 64 + k % 64, mask) >> (((k // 64) % 2) * 4)) & 15
        hi = (u8_at(blk + 128 + h * 32 + k % 32, mask) >> (((k // 32) % 4) * 2)) & 3
        sc = tl.load((blk + 192 + k // 16).to(tl.pointer_type(tl.int8)), mask=mask)
        q = (lo | (hi << 4)) - 32
        # gguf: (d * sc) * q.
        v = (f16_at(blk + 208, mask) * sc.to(tl.float32)) * q.to(tl.float32)

    if OUT == tl.float32:
        out = v
    elif OUT == tl.bfloat16:
        out = f32_to_bf16_rne(v)
    else:
        out = v.to(OUT)  # f32 -> f16, round to nearest even
    out = tl.where(failed, tl.full([BLOCK], float("nan"), tl.float32).to(OUT), out)
    tl.store(out_ptr + row * cols + offs, out, mask=in_row)


FORMAT_NAMES = tuple(BLOCK_FORMATS)


def decode_blocks_triton(staged: torch.Tensor | None, fmt: RowFormat, scale: float,
                         out: torch.Tensor, status: torch.Tensor | None = None,
                         tiers: TierRead | None = None) -> torch.Tensor:
    """Decode staged row ``i`` of GGUF blocks (uint8 ``[n, row_bytes]``,
    contiguous) into ``out[i]`` (``[n, cols]`` float32/float16/bfloat16,
    contiguous); returns ``out``.  The signature of ``decode_rows_triton``;
    ``scale`` is unused (block formats carry their own scales).
    ``status``: an int32 word; when it is nonzero at run time every value is NaN.
    ``tiers``: read each row where it lies instead (``launch_decoder``)."""
    if fmt.name not in FORMAT_NAMES:
        raise ValueError(f"no Triton block decoder for row format {fmt.name!r}")
    return launch_decoder(decode_blocks_kernel, staged, fmt, out, status, tiers, QK=fmt.block_size,
                          BB=fmt.block_bytes, **LAUNCH_OPTIONS)
