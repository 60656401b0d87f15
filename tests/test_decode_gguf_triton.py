"""The Triton decoder of GGUF block rows (kernels/decode_gguf_triton.py), without a GPU.

* Under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors): bit-identical to
  ``gguf.quants.dequantize`` followed by torch's cast, for Q8_0, Q4_0, IQ4_NL,
  Q4_K and Q6_K, every output dtype, rows of 1, 2 and 5 blocks.  The blocks are
  random bytes with random finite f16 scales (subnormals, -0 and the largest
  included), so every nibble, bit pair and 6-bit scale/min pattern occurs.
* Compiled with ``triton.compile`` for sm_70, sm_75, sm_80 and sm_90 (in a
  subprocess without TRITON_INTERPRET), with the options the launcher uses:
  PTX and cubin come out, the PTX has no fp8 or bf16 conversion instruction (the
  kernel must run on V100 and Turing), no flush to zero, and no FMA (gguf rounds
  each product and difference on its own; with fusion on, Q4_K's ``d * q - m``
  does fuse).

The interpreter runs the kernel's Python with numpy, so it checks the kernel's
operations, not what ptxas makes of them; the compile tests check the
instructions.  It cannot check the order of the products: they are all exact
in float32 (see the kernel's docstring), so any order gives the same bits.
Nothing here runs on a GPU.

TRITON_INTERPRET is read when ``@triton.jit`` decorates a function, so the
interpreted copies of the kernel module and of the modules it imports kernels
from (kernels/decode_triton.py's bf16 rounding, kernels/tier_rows_triton.py's
row sources) are loaded privately with the variable set for the load only
(helpers.load_interpreted).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")
gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402
from helpers import (COMPILE_CCS, OUT_SIGNATURE, assert_runs_on_old_gpus, assert_same_bits_but_nan,  # noqa: E402
                     compile_for_targets, dtype_id, load_interpreted)

import ple.kernels  # noqa: E402
from ple.formats import BLOCK_FORMATS, FORMATS, OUTPUT_DTYPES  # noqa: E402

KERNELS = Path(ple.kernels.__path__[0])
FORMAT_NAMES = ("q8_0", "q4_0", "iq4_nl", "q4_k", "q6_k")
BLOCKS_PER_ROW = (1, 2, 5)
ROWS = 4
# Byte offsets of the f16 scales in a block (gguf/quants.py's layouts).
F16_SCALE_OFFSETS = {"q8_0": (0,), "q4_0": (0,), "iq4_nl": (0,), "q4_k": (0, 2), "q6_k": (208,)}
# Finite f16 scales worth having: 0, -0, smallest and largest subnormals, smallest
# normal, largest finite, 1, -1.
F16_SPECIAL_BITS = (0x0000, 0x8000, 0x0001, 0x83FF, 0x0400, 0x7BFF, 0xFBFF, 0x3C00, 0xBC00)
@pytest.fixture(scope="module")
def interp():
    """The kernel module with its kernels interpreted (helpers.load_interpreted);
    its ``from ple.kernels.decode_triton import ...`` gets interpreted functions too."""
    mod = load_interpreted(KERNELS / "decode_gguf_triton.py")
    assert type(mod.decode_blocks_kernel).__name__ == "InterpretedFunction"
    assert type(mod.f32_to_bf16_rne).__name__ == "InterpretedFunction"
    return mod


# --- staged blocks ----------------------------------------------------------------

def random_f16_bits(rng: np.random.Generator, shape) -> np.ndarray:
    """Random finite f16 bit patterns: an all-ones exponent (inf/nan) loses its top bit."""
    bits = rng.integers(0, 1 << 16, shape, dtype=np.uint16)
    return np.where((bits & 0x7C00) == 0x7C00, bits & 0xBFFF, bits).astype(np.uint16)


def staged_blocks(name: str, blocks: int, seed: int, rows: int = ROWS) -> torch.Tensor:
    """uint8 ``[rows, blocks * block_bytes]``: random block bytes, finite f16 scales
    (the special ones first)."""
    fmt = BLOCK_FORMATS[name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows * blocks, fmt.block_bytes), dtype=np.uint8)
    for i, offset in enumerate(F16_SCALE_OFFSETS[name]):
        bits = random_f16_bits(rng, rows * blocks)
        specials = np.roll(np.array(F16_SPECIAL_BITS, dtype=np.uint16), i)[: bits.size]
        bits[: specials.size] = specials
        raw[:, offset:offset + 2] = bits.view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(raw.reshape(rows, blocks * fmt.block_bytes))


def reference(staged: torch.Tensor, name: str, dtype: torch.dtype) -> torch.Tensor:
    fmt = BLOCK_FORMATS[name]
    values = dequantize(staged.numpy(), GGMLQuantizationType(fmt.gguf_type))
    assert values.dtype == np.float32
    return torch.from_numpy(values).to(dtype)


def assert_bit_identical(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert not ref.isnan().any()  # finite scales: a NaN would be excused below
    assert_same_bits_but_nan(out, ref)


def decode(interp, staged: torch.Tensor, name: str, dtype: torch.dtype) -> torch.Tensor:
    """Decode into the first rows of a buffer with one guard row past them: a
    store outside the mask would show there."""
    fmt = BLOCK_FORMATS[name]
    n = staged.shape[0]
    cols = staged.shape[1] // fmt.block_bytes * fmt.block_size
    buf = torch.full((n + 1, cols), 1234.0, dtype=dtype)
    out = buf[:n]
    assert interp.decode_blocks_triton(staged, fmt, 1.0, out) is out
    assert (buf[n] == 1234.0).all()
    return out


# --- interpreter: values ----------------------------------------------------------

@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy's f32 -> f16 cast to inf
@pytest.mark.parametrize("blocks", BLOCKS_PER_ROW, ids=lambda b: f"{b}blk")
@pytest.mark.parametrize("dtype", OUTPUT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_matches_gguf_dequantize(interp, name, dtype, blocks):
    staged = staged_blocks(name, blocks, seed=blocks)
    assert_bit_identical(decode(interp, staged, name, dtype), reference(staged, name, dtype))


@pytest.mark.parametrize("dtype", OUTPUT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("name", ("q8_0", "q4_0"))
def test_matches_gguf_on_quantized_rows(interp, name, dtype):
    """Rows as gguf.quants.quantize writes them, from normal-looking weights."""
    fmt = BLOCK_FORMATS[name]
    weights = np.random.default_rng(7).standard_normal((3, 5 * fmt.block_size)).astype(np.float32) * 0.02
    staged = torch.from_numpy(quantize(weights, GGMLQuantizationType(fmt.gguf_type)))
    assert_bit_identical(decode(interp, staged, name, dtype), reference(staged, name, dtype))


def test_iq4_nl_levels_are_ggufs(interp):
    assert interp.IQ4_NL_VALUES == tuple(gguf.quants.IQ4_NL.kvalues)


def test_block_formats_are_all_covered(interp):
    assert set(interp.FORMAT_NAMES) == set(FORMAT_NAMES) == set(BLOCK_FORMATS)


@pytest.mark.parametrize("dtype", OUTPUT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_zero_rows(interp, name, dtype):
    fmt = BLOCK_FORMATS[name]
    staged = torch.empty(0, 2 * fmt.block_bytes, dtype=torch.uint8)
    out = torch.empty(0, 2 * fmt.block_size, dtype=dtype)
    assert interp.decode_blocks_triton(staged, fmt, 1.0, out) is out


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", OUTPUT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_failed_status_gives_nan_rows(interp, name, dtype):
    fmt = BLOCK_FORMATS[name]
    staged = staged_blocks(name, 2, seed=3)
    out = torch.zeros(staged.shape[0], 2 * fmt.block_size, dtype=dtype)
    interp.decode_blocks_triton(staged, fmt, 1.0, out, status=torch.ones(1, dtype=torch.int32))
    assert out.isnan().all()


def test_launch_disables_fp_fusion(interp, monkeypatch):
    """The compile tests below compile with LAUNCH_OPTIONS; the launcher must pass them."""
    assert interp.LAUNCH_OPTIONS == {"enable_fp_fusion": False}
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(kwargs)

    monkeypatch.setattr(interp, "decode_blocks_kernel", Recorder())
    fmt = BLOCK_FORMATS["q4_k"]
    interp.decode_blocks_triton(staged_blocks("q4_k", 1, seed=0), fmt, 1.0, torch.empty(ROWS, 256))
    assert len(launches) == 1 and launches[0]["enable_fp_fusion"] is False


def test_rejects_mismatched_shapes(interp):
    q8 = BLOCK_FORMATS["q8_0"]
    with pytest.raises(ValueError):  # 2 blocks staged, 1 block of values
        interp.decode_blocks_triton(torch.zeros(3, 68, dtype=torch.uint8), q8, 1.0, torch.empty(3, 32))
    with pytest.raises(ValueError):  # not a whole number of blocks
        interp.decode_blocks_triton(torch.zeros(3, 34, dtype=torch.uint8), q8, 1.0, torch.empty(3, 33))
    with pytest.raises(ValueError):
        interp.decode_blocks_triton(torch.zeros(3, 34, dtype=torch.uint8), q8, 1.0,
                                    torch.empty(3, 32, dtype=torch.float64))
    with pytest.raises(ValueError):  # not a block format: decode_triton.py's job
        interp.decode_blocks_triton(torch.zeros(3, 32, dtype=torch.uint8), FORMATS["u8"], 1.0,
                                    torch.empty(3, 32))


# --- compilation for SM70, SM75, SM80, SM90 without a GPU ------------------------

FMA = re.compile(r"\b(fma|mad)\.[\w.]*f(16|32)(x2)?\b")  # a fused float multiply-add

COMPILE_SCRIPT = r"""
from ple.formats import BLOCK_FORMATS
from ple.kernels.decode_gguf_triton import decode_blocks_kernel, LAUNCH_OPTIONS
from ple.kernels.decode_triton import MAX_BLOCK
assert type(decode_blocks_kernel).__name__ == "JITFunction"

def build(cc, name, out, options):
    fmt = BLOCK_FORMATS[name]
    signature = {"rows_ptr": "*u8", "status_ptr": "*i32", "out_ptr": "*" + out, "cols": "i32",
                 "row_bytes": "i32", **NO_TIERS_SIGNATURE, "FMT": "constexpr", "BLOCK": "constexpr",
                 **{name: "constexpr" for name in NO_TIERS_CONSTEXPRS}, "QK": "constexpr", "BB": "constexpr"}
    src = triton.compiler.ASTSource(fn=decode_blocks_kernel, signature=signature, constexprs={
        "FMT": name, "BLOCK": MAX_BLOCK, **NO_TIERS_CONSTEXPRS, "QK": fmt.block_size, "BB": fmt.block_bytes})
    return compile_summary(src, cc, options)

results = {}
for cc in json.loads(sys.argv[1]):
    for name in json.loads(sys.argv[2]):
        for out in json.loads(sys.argv[3]):
            results[f"{cc}-{name}-{out}"] = build(cc, name, out, LAUNCH_OPTIONS)
# The same Q4_K kernel with fusion on: shows the FMA check below can see one.
results["fused-q4_k"] = build(75, "q4_k", "fp32", {**LAUNCH_OPTIONS, "enable_fp_fusion": True})
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Every (target, format, output dtype) compiled in one subprocess."""
    return compile_for_targets(COMPILE_SCRIPT, FORMAT_NAMES, tmp_path_factory.mktemp("triton-cache"))


@pytest.mark.parametrize("dtype", OUTPUT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("cc", COMPILE_CCS, ids=lambda cc: f"sm_{cc}")
def test_compiles_for_target(compiled, cc, name, dtype):
    result = compiled[f"{cc}-{name}-{OUT_SIGNATURE[dtype]}"]
    assert_runs_on_old_gpus(result, cc)
    assert not FMA.search(result["ptx"])  # each product and difference rounded on its own, as gguf does


def test_fma_check_sees_fused_q4_k(compiled):
    result = compiled["fused-q4_k"]
    assert "error" not in result, result.get("error")
    assert FMA.search(result["ptx"])
