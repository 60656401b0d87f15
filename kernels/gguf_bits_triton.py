"""What the GGUF block decoders share (kernels/decode_gguf_triton.py,
kernels/decode_gguf_k_triton.py, kernels/decode_gguf_iq_triton.py): reading
the little-endian fields of a block at any byte address, the short level
tables of the non-linear formats, and the store of a program's values in the
output dtype.

Bit-identical to the CPU decoder (kernels/decode.py, which runs
``gguf.quants.dequantize`` and then torch's cast): each decoder computes every
value in float32 with the operations gguf does, in its order, then
``store_values`` casts as kernels/decode_triton.py casts (round to nearest
even).  They run on V100 (SM70) and Turing (SM75): f16 scales are widened
with the f16 -> f32 conversion (exact, and present on every target), the
other scales are built from their bits with integer operations, bf16 is
rounded with integer operations (decode_triton's helper), and nothing else
needs a newer instruction.  The launches disable FP fusion (LAUNCH_OPTIONS),
so that no FMA merges a product with gguf's following sum or difference.

Each decoder program decodes ``BLOCK`` consecutive values of one row, one per
lane; a lane reads the bytes of its own value and of its block's scales
(lanes of one block read the same scale bytes, which the caches serve).

Only imported where triton is available.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ple.kernels.decode_triton import f32_to_bf16_rne

# Compile options of every launch.  No FP fusion: gguf (numpy) rounds each
# product, sum and difference on its own, an FMA does not.
LAUNCH_OPTIONS = {"enable_fp_fusion": False}

# IQ4_NL's 16 non-linear levels (gguf.quants.IQ4_NL.kvalues), which IQ4_XS uses too.
IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# The E2M1 values doubled (gguf.quants.MXFP4.kvalues), of MXFP4 and NVFP4.
E2M1_DOUBLED_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def pack_int8(values) -> int:
    """``values`` (at most 8) as int8 bytes packed little-endian into one int64."""
    return int.from_bytes(bytes(v & 0xFF for v in values), "little", signed=True)


# Each table of 16 levels as two int64 words, levels 0-7 and 8-15: a lane picks
# its level with a select and a shift instead of a load from memory.
IQ4_NL_LO: tl.constexpr = tl.constexpr(pack_int8(IQ4_NL_VALUES[:8]))
IQ4_NL_HI: tl.constexpr = tl.constexpr(pack_int8(IQ4_NL_VALUES[8:]))
E2M1_LO: tl.constexpr = tl.constexpr(pack_int8(E2M1_DOUBLED_VALUES[:8]))
E2M1_HI: tl.constexpr = tl.constexpr(pack_int8(E2M1_DOUBLED_VALUES[8:]))


@triton.jit
def level16(nib, LO: tl.constexpr, HI: tl.constexpr):
    """Level ``nib`` (int32 0..15) of the table packed as ``LO``, ``HI``, as int32."""
    word = tl.where(nib < 8, LO, HI)
    byte = ((word >> ((nib & 7) * 8)) & 0xFF).to(tl.int32)
    return (byte ^ 0x80) - 0x80  # sign-extend the int8


@triton.jit
def u8_at(ptr, mask):
    return tl.load(ptr, mask=mask).to(tl.int32)


@triton.jit
def u16_at(ptr, mask):
    """The little-endian uint16 at byte address ``ptr`` (any alignment), as int32."""
    return u8_at(ptr, mask) | (u8_at(ptr + 1, mask) << 8)


@triton.jit
def f16_at(ptr, mask):
    """The little-endian f16 at byte address ``ptr`` (any alignment), as float32."""
    # f16 -> f32 is exact (subnormals too) and is cvt.f32.f16 on every target,
    # the conversion decode_triton.py uses for f16 rows.
    return u16_at(ptr, mask).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def store_values(out_ptr, row, cols, offs, v, failed, BLOCK: tl.constexpr):
    """Stores the float32 values ``v`` of lanes ``offs`` (those below ``cols``)
    of output row ``row``, cast to the output's element type; NaN when the
    call ``failed``."""
    OUT: tl.constexpr = out_ptr.dtype.element_ty
    if OUT == tl.float32:
        out = v
    elif OUT == tl.bfloat16:
        out = f32_to_bf16_rne(v)
    else:
        out = v.to(OUT)  # f32 -> f16, round to nearest even
    out = tl.where(failed, tl.full([BLOCK], float("nan"), tl.float32).to(OUT), out)
    tl.store(out_ptr + row * cols + offs, out, mask=offs < cols)
