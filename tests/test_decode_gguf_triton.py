"""The Triton decoders of GGUF block rows (kernels/decode_gguf_triton.py and the
family kernels it launches), without a GPU.

* Under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors): bit-identical to
  ``gguf.quants.dequantize`` followed by torch's cast, for every block format
  ple reads, every output dtype, rows of 1, 2 and 5 blocks and rows wider than
  a program's column block.  The blocks are random bytes with random finite
  f16 scales (subnormals, -0 and the largest included), so that quants,
  signs, grid indices and sub-block scales take all their bit patterns; rows
  that gguf can quantize to are also gguf's quantization of normal-looking
  weights.  Infinite and NaN
  f16 scales, every MXFP4 and NVFP4 scale byte, and arbitrary bytes
  (hypothesis) compare too: NaN need only be NaN where gguf's is, every other
  value (infinities and -0 included) to the bit.
* Compiled with ``triton.compile`` for sm_70, sm_75, sm_80 and sm_90 (in a
  subprocess without TRITON_INTERPRET; every format, and each kernel's store
  to every output dtype), with the options the launchers use:
  PTX and cubin come out, the PTX has no fp8 or bf16 conversion instruction (the
  kernels must run on V100 and Turing), no flush to zero, and no FMA (gguf rounds
  each product, sum and difference on its own; with fusion on, Q4_K's
  ``d * q - m`` does fuse).

The interpreter runs the kernels' Python with numpy, so it checks the kernels'
operations, not what ptxas makes of them; the compile tests check the
instructions, and the CUDA tests (skipped without a GPU) the GPU's values,
against gguf's (as tests/test_gguf_table.py's CUDA tests do through the
operator).

TRITON_INTERPRET is read when ``@triton.jit`` decorates a function, so the
interpreted copies of the kernel modules and of the modules they import
kernels from are loaded privately with the variable set for the load only
(helpers.load_interpreted).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")
gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from helpers import (COMPILE_CCS, F16_SPECIAL_BITS, GGUF_F16_SCALES, OUT_SIGNATURE,  # noqa: E402
                     assert_runs_on_old_gpus, assert_same_bits_but_nan, compile_in_subprocess,
                     dtype_id, load_interpreted, random_gguf_blocks)

import ple.kernels  # noqa: E402
from ple.formats import BLOCK_FORMATS, FORMATS, OUTPUT_DTYPES  # noqa: E402
from ple.gguf_grids import GRID_OF_FORMAT, format_grid  # noqa: E402

KERNELS = Path(ple.kernels.__path__[0])
FORMAT_NAMES = tuple(BLOCK_FORMATS)
BLOCKS_PER_ROW = (1, 2, 5)
ROWS = 4
# The formats gguf.quants.quantize writes.
QUANTIZED = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "tq1_0", "tq2_0", "mxfp4")
# f16 scales that are not finite: inf, -inf, a quiet and a signalling NaN.
F16_NONFINITE_BITS = (0x7C00, 0xFC00, 0x7E00, 0xFD01)

# gguf warns of its own overflows and NaNs (numpy's f32 -> f16 cast to inf,
# inf * 0), which these tests provoke.
pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]


@pytest.fixture(scope="module")
def interp():
    """The kernel module with its kernels interpreted (helpers.load_interpreted);
    the family modules it launches, and what they import, are interpreted too."""
    mod = load_interpreted(KERNELS / "decode_gguf_triton.py")
    for launcher, kernel, _ in FAMILIES:
        assert type(getattr(mod, launcher).__globals__[kernel]).__name__ == "InterpretedFunction"
    return mod


# Each family of formats: its launcher (which kernels/decode_gguf_triton.py
# holds or imports), its kernel, and the tuple of its formats' names.
FAMILIES = (("decode_blocks_triton", "decode_blocks_kernel", "FORMAT_NAMES"),
            ("decode_k_blocks_triton", "decode_k_blocks_kernel", "K_FORMAT_NAMES"),
            ("decode_iq_blocks_triton", "decode_iq_blocks_kernel", "IQ_FORMAT_NAMES"))


def family(interp, name: str) -> tuple[dict, str]:
    """The globals of the interpreted module whose kernel decodes format
    ``name`` (the family modules are in no sys.modules entry once loaded),
    and that kernel's name."""
    for launcher, kernel, names in FAMILIES:
        module = getattr(interp, launcher).__globals__
        if name in module[names]:
            return module, kernel
    raise KeyError(name)


# --- staged blocks ----------------------------------------------------------------

def staged_blocks(name: str, blocks: int, seed: int, rows: int = ROWS,
                  specials=F16_SPECIAL_BITS) -> torch.Tensor:
    """uint8 ``[rows, blocks * block_bytes]`` of random_gguf_blocks."""
    raw = random_gguf_blocks(name, rows * blocks, np.random.default_rng(seed), specials)
    return torch.from_numpy(raw.reshape(rows, -1))


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


def wide_blocks(name: str) -> int:
    """Blocks of a row wider than two column blocks of the decoders (MAX_BLOCK values)."""
    return -(-2200 // BLOCK_FORMATS[name].block_size)


# --- interpreter: values ----------------------------------------------------------

@pytest.mark.parametrize("blocks", BLOCKS_PER_ROW, ids=lambda b: f"{b}blk")
@pytest.mark.parametrize("dtype", OUTPUT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_matches_gguf_dequantize(interp, name, dtype, blocks):
    staged = staged_blocks(name, blocks, seed=blocks)
    assert_bit_identical(decode(interp, staged, name, dtype), reference(staged, name, dtype))


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_rows_of_several_column_blocks(interp, name):
    staged = staged_blocks(name, wide_blocks(name), seed=11, rows=2)
    fmt = BLOCK_FORMATS[name]
    assert staged.shape[1] // fmt.block_bytes * fmt.block_size > 2048
    out = decode(interp, staged, name, torch.float32)
    assert_bit_identical(out, reference(staged, name, torch.float32))


@pytest.mark.parametrize("dtype", OUTPUT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("name", QUANTIZED)
def test_matches_gguf_on_quantized_rows(interp, name, dtype):
    """Rows as gguf.quants.quantize writes them, from normal-looking weights."""
    fmt = BLOCK_FORMATS[name]
    weights = np.random.default_rng(7).standard_normal((3, 5 * fmt.block_size)).astype(np.float32) * 0.02
    staged = torch.from_numpy(quantize(weights, GGMLQuantizationType(fmt.gguf_type)))
    assert_bit_identical(decode(interp, staged, name, dtype), reference(staged, name, dtype))


@pytest.mark.parametrize("dtype", OUTPUT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("name", [n for n in FORMAT_NAMES if GGUF_F16_SCALES[n]])
def test_nonfinite_scales(interp, name, dtype):
    """inf, -inf and NaN f16 scales (and -0): infinities, NaN (inf * 0) and
    signed zeros where gguf has them."""
    staged = staged_blocks(name, 3, seed=5, specials=F16_NONFINITE_BITS + (0x8000,))
    ref = reference(staged, name, torch.float32)
    assert ref.isnan().any() and ref.isinf().any()
    assert_same_bits_but_nan(decode(interp, staged, name, dtype), ref.to(dtype))


def every_scale_byte(name: str) -> torch.Tensor:
    """MXFP4 or NVFP4 rows whose scale bytes are 0..255, other bytes random."""
    fmt = BLOCK_FORMATS[name]
    scales_per_block = fmt.block_size // (32 if name == "mxfp4" else 16)
    raw = np.random.default_rng(3).integers(0, 256, (256 // scales_per_block, fmt.block_bytes),
                                            dtype=np.uint8)
    raw[:, :scales_per_block] = np.arange(256, dtype=np.uint8).reshape(-1, scales_per_block)
    return torch.from_numpy(raw.reshape(8, -1))


@pytest.mark.parametrize("dtype", OUTPUT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("name", ["mxfp4", "nvfp4"])
def test_every_scale_byte(interp, name, dtype):
    """Every value of the byte scales of MXFP4 (E8M0; the largest overflow to
    infinity, as gguf's do) and NVFP4 (unsigned E4M3; a zero scale gives -0
    for negative levels)."""
    staged = every_scale_byte(name)
    ref = reference(staged, name, torch.float32)
    assert not ref.isnan().any()
    if name == "mxfp4":
        assert ref.isinf().any()
    else:
        assert ((ref == 0) & torch.signbit(ref)).any()
    assert_same_bits_but_nan(decode(interp, staged, name, dtype), ref.to(dtype))


def special_rows(name: str) -> list[torch.Tensor]:
    """What the tests above decode of format ``name``, but quantized rows: rows
    of 5 blocks, wide rows, rows with non-finite scales or every scale byte."""
    rows = [staged_blocks(name, 5, seed=1), staged_blocks(name, wide_blocks(name), seed=2, rows=2)]
    if GGUF_F16_SCALES[name]:
        rows.append(staged_blocks(name, 3, seed=5, specials=F16_NONFINITE_BITS + (0x8000,)))
    else:
        rows.append(every_scale_byte(name))
    return rows


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", OUTPUT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_cuda_matches_gguf_dequantize(name, dtype):
    """The compiled decoders on the GPU: gguf's values (NaN where gguf's is
    NaN), rows staged in device memory and in pinned host memory (read over UVA)."""
    from ple.kernels import decode_gguf_triton
    assert type(decode_gguf_triton.decode_blocks_kernel).__name__ == "JITFunction"
    fmt = BLOCK_FORMATS[name]
    for staged in special_rows(name):
        cols = staged.shape[1] // fmt.block_bytes * fmt.block_size
        want = reference(staged, name, dtype)
        for rows in (staged.cuda(), staged.pin_memory()):
            out = torch.empty(staged.shape[0], cols, dtype=dtype, device="cuda")
            decode_gguf_triton.decode_blocks_triton(rows, fmt, 1.0, out)
            assert_same_bits_but_nan(out, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_grid_copied_first_inside_a_capture_is_an_error(monkeypatch):
    """A grid reaches a device by a copy from the host, which a CUDA graph
    cannot capture: the first decode of its format there must come before."""
    from ple.kernels import decode_gguf_iq_triton as iq
    monkeypatch.setattr(iq, "_grids", {})
    fmt = BLOCK_FORMATS["iq2_xs"]
    staged = staged_blocks("iq2_xs", 2, seed=0)
    rows, out = staged.cuda(), torch.empty(ROWS, 512, device="cuda")
    with pytest.raises(RuntimeError, match="gather from the table once on cuda:0 before capturing"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            iq.decode_iq_blocks_triton(rows, fmt, 1.0, out)
    iq.decode_iq_blocks_triton(rows, fmt, 1.0, out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        iq.decode_iq_blocks_triton(rows, fmt, 1.0, out)
    out.zero_()
    graph.replay()
    assert_bit_identical(out, reference(staged, "iq2_xs", torch.float32))


# database=None: no .hypothesis directory in the repository; the same examples
# every run (derandomize) unless PLE_FUZZ_EXAMPLES asks for a longer search.
FUZZ = settings(max_examples=int(os.environ.get("PLE_FUZZ_EXAMPLES", 30)), deadline=None,
                database=None, derandomize="PLE_FUZZ_EXAMPLES" not in os.environ,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@FUZZ
@given(name=st.sampled_from(FORMAT_NAMES), dtype=st.sampled_from(OUTPUT_DTYPES),
       data=st.data())
def test_arbitrary_bytes_match_gguf(interp, name, dtype, data):
    """Any bytes at all, scales included: NaN where gguf's is NaN, every other
    value to the bit."""
    fmt = BLOCK_FORMATS[name]
    rows, blocks = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3))
    raw = data.draw(st.binary(min_size=rows * blocks * fmt.block_bytes,
                              max_size=rows * blocks * fmt.block_bytes))
    staged = torch.frombuffer(bytearray(raw), dtype=torch.uint8).reshape(rows, -1)
    assert_same_bits_but_nan(decode(interp, staged, name, dtype), reference(staged, name, dtype))


def test_level_tables_are_ggufs(interp):
    bits = interp.level16.fn.__globals__
    assert bits["IQ4_NL_VALUES"] == tuple(gguf.quants.IQ4_NL.kvalues)
    assert (bits["E2M1_DOUBLED_VALUES"] == tuple(gguf.quants.MXFP4.kvalues)
            == tuple(gguf.quants.NVFP4.kvalues))


@pytest.mark.parametrize("name", sorted(GRID_OF_FORMAT))
def test_grids_are_ggufs(interp, name):
    """ple's grids (ple/gguf_grids.py) hold gguf's values, one table a grid:
    IQ1_M's is IQ1_S's, on the host and on a device."""
    cls = getattr(gguf.quants, GRID_OF_FORMAT[name])
    cls.init_grid()
    assert np.array_equal(format_grid(name).astype(np.float32), cls.grid.reshape(cls.grid_shape))
    grid_on = interp.decode_iq_blocks_triton.__globals__["grid_on"]
    on_cpu = grid_on(BLOCK_FORMATS[name], torch.device("cpu"))
    assert np.array_equal(on_cpu.numpy(), format_grid(name).reshape(-1))
    assert grid_on(BLOCK_FORMATS[name], torch.device("cpu")) is on_cpu
    if name == "iq1_m":
        assert format_grid("iq1_m") is format_grid("iq1_s")
        assert grid_on(BLOCK_FORMATS["iq1_s"], torch.device("cpu")) is on_cpu


def test_ksigns_are_seven_bits_and_their_parity():
    """The decoder computes gguf's sign table (``ksigns``) instead of reading it."""
    index = np.arange(128)
    parity = np.array([bin(i).count("1") & 1 for i in index])
    assert np.array_equal(np.frombuffer(gguf.quants.IQ2_XXS.ksigns, dtype=np.uint8),
                          index | (parity << 7))


def test_block_formats_are_all_covered(interp):
    names = [getattr(interp, launcher).__globals__[names] for launcher, _, names in FAMILIES]
    assert sorted(sum(names, ())) == sorted(FORMAT_NAMES)


@pytest.mark.parametrize("dtype", OUTPUT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_zero_rows(interp, name, dtype):
    fmt = BLOCK_FORMATS[name]
    staged = torch.empty(0, 2 * fmt.block_bytes, dtype=torch.uint8)
    out = torch.empty(0, 2 * fmt.block_size, dtype=dtype)
    assert interp.decode_blocks_triton(staged, fmt, 1.0, out) is out


@pytest.mark.parametrize("dtype", OUTPUT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_failed_status_gives_nan_rows(interp, name, dtype):
    fmt = BLOCK_FORMATS[name]
    staged = staged_blocks(name, 2, seed=3)
    out = torch.zeros(staged.shape[0], 2 * fmt.block_size, dtype=dtype)
    interp.decode_blocks_triton(staged, fmt, 1.0, out, status=torch.ones(1, dtype=torch.int32))
    assert out.isnan().all()


@pytest.mark.parametrize("name", ["q4_1", "q5_k", "iq2_xxs"])
def test_launch_disables_fp_fusion(interp, monkeypatch, name):
    """The compile tests below compile with LAUNCH_OPTIONS; the launchers must pass them."""
    module, kernel = family(interp, name)
    assert module["LAUNCH_OPTIONS"] == {"enable_fp_fusion": False}
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(kwargs)

    monkeypatch.setitem(module, kernel, Recorder())
    fmt = BLOCK_FORMATS[name]
    interp.decode_blocks_triton(staged_blocks(name, 1, seed=0), fmt, 1.0,
                                torch.empty(ROWS, fmt.block_size))
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
    with pytest.raises(ValueError, match="no Triton block decoder for row format 'u8'"):
        interp.decode_blocks_triton(torch.zeros(3, 32, dtype=torch.uint8), FORMATS["u8"], 1.0,
                                    torch.empty(3, 32))


# --- compilation for SM70, SM75, SM80, SM90 without a GPU ------------------------

FMA = re.compile(r"\b(fma|mad)\.[\w.]*f(16|32)(x2)?\b")  # a fused float multiply-add

COMPILE_SCRIPT = r"""
from ple.formats import BLOCK_FORMATS
from ple.kernels.decode_gguf_triton import FORMAT_NAMES, decode_blocks_kernel
from ple.kernels.decode_gguf_iq_triton import IQ_FORMAT_NAMES, decode_iq_blocks_kernel
from ple.kernels.decode_gguf_k_triton import decode_k_blocks_kernel
from ple.kernels.decode_triton import MAX_BLOCK
from ple.kernels.gguf_bits_triton import LAUNCH_OPTIONS
assert type(decode_blocks_kernel).__name__ == "JITFunction"

def build(cc, name, out, options):
    fmt = BLOCK_FORMATS[name]
    args = {}
    if name in FORMAT_NAMES:
        kernel, meta = decode_blocks_kernel, {"QK": fmt.block_size, "BB": fmt.block_bytes}
    elif name in IQ_FORMAT_NAMES:
        kernel, meta, args = decode_iq_blocks_kernel, {"BB": fmt.block_bytes}, {"grid_ptr": "*i8"}
    else:
        kernel, meta = decode_k_blocks_kernel, {"BB": fmt.block_bytes}
    constexprs = {"FMT": name, "BLOCK": MAX_BLOCK, **NO_TIERS_CONSTEXPRS, **meta}
    signature = {"rows_ptr": "*u8", "status_ptr": "*i32", "out_ptr": "*" + out, "cols": "i32",
                 "row_bytes": "i32", **NO_TIERS_SIGNATURE, **args,
                 **{c: "constexpr" for c in constexprs}}
    src = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return compile_summary(src, cc, options)

results = {}
for cc in json.loads(sys.argv[1]):
    for name, out in json.loads(sys.argv[2]):
        results[f"{cc}-{name}-{out}"] = build(cc, name, out, LAUNCH_OPTIONS)
# The same Q4_K kernel with fusion on: shows the FMA check below can see one.
results["fused-q4_k"] = build(75, "q4_k", "fp32", {**LAUNCH_OPTIONS, "enable_fp_fusion": True})
print(json.dumps(results))
"""


# What is compiled for each target: every format to float32, and one format of
# each kernel to every output dtype.  The output dtype changes only the store
# (gguf_bits_triton.store_values), which every format of a kernel shares: the
# values are float32 until then.
COMPILED = ([(name, torch.float32) for name in FORMAT_NAMES]
            + [(name, dtype) for name in ("q4_1", "q5_k", "iq2_s")
               for dtype in OUTPUT_DTYPES if dtype != torch.float32])


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Every target and COMPILED pair compiled in one subprocess (about a minute)."""
    pairs = [(name, OUT_SIGNATURE[dtype]) for name, dtype in COMPILED]
    return compile_in_subprocess(COMPILE_SCRIPT, [COMPILE_CCS, pairs],
                                 tmp_path_factory.mktemp("triton-cache"))


@pytest.mark.slow
@pytest.mark.parametrize("name, dtype", COMPILED,
                         ids=lambda x: x if isinstance(x, str) else dtype_id(x))
@pytest.mark.parametrize("cc", COMPILE_CCS, ids=lambda cc: f"sm_{cc}")
def test_compiles_for_target(compiled, cc, name, dtype):
    result = compiled[f"{cc}-{name}-{OUT_SIGNATURE[dtype]}"]
    assert_runs_on_old_gpus(result, cc)
    assert not FMA.search(result["ptx"])  # each product and sum rounded on its own, as gguf does


@pytest.mark.slow
def test_fma_check_sees_fused_q4_k(compiled):
    result = compiled["fused-q4_k"]
    assert "error" not in result, result.get("error")
    assert FMA.search(result["ptx"])
