"""The arithmetic of scaled rows (fp8_e4m3fn, u8, i8) in every output dtype.

``round_scale=False`` gives ``(values.to(float32) * scale).to(dtype)``;
``round_scale=True`` gives ``values.to(dtype) * scale.to(dtype)``, what a
model holding its scale in its own dtype computes (transformers'
``FP8Embedding``: tests/test_fp8_transformers.py checks against the module
itself).  The references are independent of ple: torch's own product of the
values and the scale cast to the dtype, and NumPy's, which decodes the FP8
bits by docs/design.md's formula, multiplies in float64 (exact for these
factors) and rounds once to the dtype.

With ``round_scale`` a ``DiskEmbedding`` holds its scale as a model holds
its ``weight_scale``, cast with the module: after ``.half()`` of a bfloat16
module the product is by the bfloat16 scale rounded again to float16, as a
model cast the same way computes.

Covered: the identity the decoders rest on (torch's float16/bfloat16 product
is the exact product rounded once, ``ple.formats.applied_scale``), the CPU
operator, the layers' choices, opcheck and torch.compile, the Triton decoder
under the interpreter, and on a GPU (skipped without one) the CUDA operator
eager, from its tiers, compiled and in a CUDA graph, against the CPU operator
and against torch's own product on the GPU.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import ple
import ple.kernels
from helpers import assert_same_bits, assert_same_bits_but_nan, dtype_id, load_interpreted
from ple.formats import FORMATS, OUTPUT_DTYPES, applied_scale
from ple.kernels.decode import decode_rows
from ple.layers import DiskEmbedding, NGramEmbedding, NGramHashing

# The scales (none a bfloat16 or float16 value) and a power of two,
# for which both arithmetics agree.
SCALES = (1e-3, 3e-4, 7.3e-5, 2.0 ** -7)
EXACT_SCALE = 2.0 ** -7
# More for the identity alone: float16 subnormal (5e-6) and overflowing
# (1e3 x 448 > 65504) products, and scales of every magnitude.
MORE_SCALES = (0.37, 0.0173, 1 / 3, 5e-6, 1e3, 2.5e-9, 7.0)
SCALED = ("fp8_e4m3fn", "u8", "i8")
COLS = 16
ROWS = 40  # 640 values: every one of the 256 byte patterns, then random bytes

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# --- the NumPy reference -------------------------------------------------------------

def stored_values(name: str, raw: np.ndarray) -> np.ndarray:
    """The values of ``raw`` bytes as float64 (NaN for FP8's two NaN patterns)."""
    if name == "u8":
        return raw.astype(np.float64)
    if name == "i8":
        return raw.view(np.int8).astype(np.float64)
    b = raw.astype(np.int64)
    exp, mant = (b >> 3) & 15, b & 7
    magnitude = np.where(exp == 0, mant * 2.0 ** -9, (1 + mant / 8) * np.exp2(exp - 7.0))
    magnitude = np.where((b & 0x7F) == 0x7F, np.nan, magnitude)
    return np.where(b >> 7 == 1, -magnitude, magnitude)


def round_to(x: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """float64 ``x`` rounded once to ``dtype`` (to nearest, ties to even), as float64."""
    if dtype == torch.float32:
        return x.astype(np.float32).astype(np.float64)
    if dtype == torch.float16:
        return x.astype(np.float16).astype(np.float64)  # subnormals and overflow to inf included
    # bfloat16: 8 significant bits.  Every value rounded here is a normal
    # bfloat16 (checked), so the exponent needs no care.
    finite = np.isfinite(x) & (x != 0)
    assert (np.abs(x[finite]) >= 2.0 ** -126).all() and (np.abs(x[finite]) < 2.0 ** 127).all()
    mantissa, exponent = np.frexp(np.where(finite, x, 1.0))
    rounded = np.ldexp(np.rint(mantissa * 2.0 ** 8), exponent - 8)  # rint: ties to even
    return np.where(finite, rounded, x)


def numpy_reference(name: str, raw: np.ndarray, scale: float, dtype: torch.dtype,
                    round_scale: bool) -> np.ndarray:
    values = stored_values(name, raw)
    scale32 = float(np.float32(scale))
    if round_scale:
        product = values * round_to(np.float64(scale32), dtype)  # exact in float64
        return round_to(product, dtype)
    return round_to(round_to(values * scale32, torch.float32), dtype)


def as_torch(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """float64 values of ``dtype`` as a ``dtype`` tensor (the cast is exact)."""
    return torch.from_numpy(values).to(dtype)


def torch_reference(name: str, raw: np.ndarray, scale: float, dtype: torch.dtype,
                    round_scale: bool, device: str = "cpu") -> torch.Tensor:
    """torch's own arithmetic: a model's ``rows.to(dtype) * weight_scale``
    with the F32 scale cast to ``dtype`` (``[1]``, as the loader keeps it), or
    the float32 product cast."""
    values = torch.from_numpy(raw).to(device).view(FORMATS[name].storage)
    scale32 = torch.tensor([scale], dtype=torch.float32, device=device)
    if round_scale:
        return values.to(dtype) * scale32.to(dtype)
    return (values.to(torch.float32) * scale32).to(dtype)


def table_bytes(seed: int = 0) -> np.ndarray:
    raw = np.random.default_rng(seed).integers(0, 256, ROWS * COLS, dtype=np.uint8)
    raw[:256] = np.arange(256)
    return raw.reshape(ROWS, COLS)


def cases(scales=SCALES):
    for name in SCALED:
        for dtype in OUTPUT_DTYPES:
            for scale in scales:
                for round_scale in (False, True):
                    yield pytest.param(name, dtype, scale, round_scale,
                                       id=f"{name}-{dtype_id(dtype)}-s{scale:g}-round{round_scale}")


# --- the identity ------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("name, dtype, scale, round_scale", list(cases(SCALES + MORE_SCALES)))
def test_torch_products_are_the_numpy_reference(name, dtype, scale, round_scale):
    """torch's float16/bfloat16 product of the values and the rounded scale
    is the exact product rounded once (and the float32 product cast is the
    double rounding the NumPy reference does): what applied_scale rests on."""
    raw = table_bytes()
    want = numpy_reference(name, raw, scale, dtype, round_scale)
    got = torch_reference(name, raw, scale, dtype, round_scale)
    assert_same_bits_but_nan(got, as_torch(want, dtype))
    # And the decoders' arithmetic, a float32 product by applied_scale's value, is torch's.
    decoded = decode_rows(torch.from_numpy(raw), FORMATS[name],
                          applied_scale(scale, dtype, round_scale), dtype)
    assert_same_bits_but_nan(decoded, got)


@pytest.mark.parametrize("dtype", OUTPUT_DTYPES, ids=dtype_id)
def test_applied_scale(dtype):
    for scale in SCALES + MORE_SCALES:
        as_f32 = torch.tensor(scale, dtype=torch.float32)
        assert applied_scale(scale, dtype, False) == as_f32.item()
        assert applied_scale(scale, dtype, True) == as_f32.to(dtype).item()
    # Through float32, as a loader casts an F32 weight_scale: this double is
    # above the tie between 1 and the next bfloat16, its float32 on the tie
    # (which rounds to even, 1.0).
    tricky = 1 + 2 ** -8 + 2 ** -30
    assert applied_scale(tricky, torch.bfloat16, True) == 1.0
    assert round_to(np.float64(tricky), torch.bfloat16) == 1 + 2 ** -7


# --- the CPU operator ----------------------------------------------------------------

@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    """{(format, scale): open table} over the same bytes, a shard family
    in two files with an F32 ``weight_scale`` of shape [1] (the published
    checkpoints' shape)."""
    raw = table_bytes()
    opened = {}
    for name in SCALED:
        for scale in SCALES:
            directory = tmp_path_factory.mktemp(f"{name}-{scale:g}")
            values = torch.from_numpy(raw).view(FORMATS[name].storage)
            save_file({"emb.shard_0.weight": values[:25].contiguous(),
                       "emb.weight_scale": torch.tensor([scale], dtype=torch.float32)},
                      str(directory / "a.safetensors"))
            save_file({"emb.shard_1.weight": values[25:].contiguous()},
                      str(directory / "b.safetensors"))
            opened[name, scale] = ple.Table.from_safetensors(directory, "emb")
    yield raw, opened
    for table in opened.values():
        table.close()


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("name, dtype, scale, round_scale", list(cases()))
def test_cpu_operator_equals_the_references(tables, name, dtype, scale, round_scale):
    raw, opened = tables
    table = opened[name, scale]
    ids = torch.cat([torch.arange(ROWS), torch.tensor([7, 0, 39, 7])])
    got = torch.ops.ple.disk_gather(ids, table.handle, dtype, round_scale)
    want = numpy_reference(name, raw[ids.numpy()], scale, dtype, round_scale)
    assert_same_bits_but_nan(got, as_torch(want, dtype))
    assert_same_bits_but_nan(got, torch_reference(name, raw[ids.numpy()], scale, dtype,
                                                  round_scale))
    assert_same_bits(ple.gather(table, ids, dtype, round_scale), got)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
@pytest.mark.parametrize("name", SCALED)
def test_the_arithmetics_differ_where_the_scale_is_not_a_value_of_the_dtype(tables, name, dtype):
    """So the tests above can tell them apart: at the issue's scales 11% to
    65% of the values differ (by one unit in the last place), at a power of
    two none do, and in float32 none ever do."""
    _, opened = tables
    ids = torch.arange(ROWS)
    for scale in SCALES:
        table = opened[name, scale]
        rounded = torch.ops.ple.disk_gather(ids, table.handle, dtype, True)
        product = torch.ops.ple.disk_gather(ids, table.handle, dtype)  # the default: False
        finite = rounded.isfinite()
        differ = float((rounded != product)[finite].float().mean())
        if scale == EXACT_SCALE:
            assert differ == 0
        else:
            assert 0.1 < differ < 0.7, (scale, differ)
            ulp = torch.finfo(dtype).eps * torch.maximum(  # one unit in the last place at most
                product.float().abs(), torch.tensor(torch.finfo(dtype).smallest_normal))
            assert ((rounded.float() - product.float()).abs() <= ulp)[finite].all()
        assert_same_bits_but_nan(torch.ops.ple.disk_gather(ids, table.handle, torch.float32, True),
                                 torch.ops.ple.disk_gather(ids, table.handle, torch.float32))


def test_round_scale_leaves_unscaled_tables_alone(tmp_path):
    values = torch.randn(30, 8)
    save_file({"w": values}, str(tmp_path / "w.safetensors"))
    with ple.Table.from_safetensors(tmp_path / "w.safetensors") as table:
        for dtype in OUTPUT_DTYPES:
            assert_same_bits(torch.ops.ple.disk_gather(torch.arange(30), table.handle, dtype, True),
                             values.to(dtype))


# --- opcheck and torch.compile ----------------------------------------------------------

@pytest.mark.parametrize("round_scale", [False, True])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16], ids=dtype_id)
def test_opcheck_with_round_scale(tables, dtype, round_scale):
    raw, opened = tables
    # Rows without FP8's NaN patterns: opcheck compares outputs without equal_nan.
    finite_rows = torch.from_numpy(np.flatnonzero(~((raw & 0x7F) == 0x7F).any(axis=1)))
    ids = finite_rows[torch.randint(0, len(finite_rows), (6, 7),
                                    generator=torch.Generator().manual_seed(1))]
    torch.library.opcheck(torch.ops.ple.disk_gather.default,
                          (ids, opened["fp8_e4m3fn", 3e-4].handle, dtype, round_scale))


@pytest.mark.slow
def test_compiled_round_scale_equals_eager(tables):
    _, opened = tables
    handle = opened["fp8_e4m3fn", 7.3e-5].handle

    def f(ids):
        return torch.ops.ple.disk_gather(ids, handle, torch.bfloat16, True) * 2

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    for seed in (0, 1):
        ids = torch.randint(0, ROWS, (50,), generator=torch.Generator().manual_seed(seed))
        assert_same_bits_but_nan(compiled(ids), f(ids))
    torch._dynamo.reset()


# --- the layers --------------------------------------------------------------------------

def test_disk_embedding_chooses_its_arithmetic(tables):
    """DiskEmbedding's default is the float32 product (an nn.Embedding over
    the dequantized table); round_scale=True is the reference models'."""
    raw, opened = tables
    table = opened["fp8_e4m3fn", 1e-3]
    ids = torch.arange(ROWS)
    for round_scale in (False, True):
        chosen = {"round_scale": True} if round_scale else {}  # else the default
        for dtype in OUTPUT_DTYPES:
            module = DiskEmbedding(table, dtype, **chosen)
            assert module.round_scale is round_scale
            assert ("round_scale=True" in repr(module)) is round_scale
            assert_same_bits_but_nan(module(ids), torch_reference("fp8_e4m3fn", raw, 1e-3, dtype,
                                                                  round_scale))
    # float64: the float32 product widened.
    module = DiskEmbedding(table, torch.float64)
    assert_same_bits_but_nan(module(ids), torch_reference("fp8_e4m3fn", raw, 1e-3, torch.float32,
                                                          False).double())
    with pytest.raises(AttributeError):  # it decides what the module holds
        module.round_scale = True


class ReferenceScaledEmbedding(torch.nn.Module):
    """A model's scaled embedding as transformers' FP8Embedding is: the
    stored values and a float32 [1] ``weight_scale`` as parameters, the
    scale cast to the model's dtype as its loader casts it, the rows
    ``embedding(ids, weight).to(weight_scale.dtype) * weight_scale``.
    ``.to()`` casts both parameters (an fp8 weight exactly, an integer one
    not at all)."""

    def __init__(self, values: torch.Tensor, scale: float, dtype: torch.dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(values, requires_grad=False)
        self.weight_scale = torch.nn.Parameter(
            torch.tensor([scale], dtype=torch.float32).to(dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = torch.nn.functional.embedding(ids, self.weight)
        return rows.to(self.weight_scale.dtype) * self.weight_scale


# Casts as a user calls them, applied in turn to a module and to its
# reference: narrowing, widening and casting back, each scale rounding again.
CASTS = (("to(float16)", lambda m: m.to(torch.float16)), ("float()", lambda m: m.float()),
         ("bfloat16()", lambda m: m.bfloat16()), ("half()", lambda m: m.half()),
         ("double()", lambda m: m.double()), ("to(bfloat16)", lambda m: m.to(torch.bfloat16)),
         ("to(float32)", lambda m: m.to(dtype=torch.float32)), ("half()", lambda m: m.half()),
         ("to(float64)", lambda m: m.to(torch.float64)), ("float()", lambda m: m.float()))


@pytest.mark.parametrize("name", SCALED)
def test_round_scale_follows_the_casts_of_the_module(tables, name):
    """After any sequence of casts, DiskEmbedding(round_scale=True) gives the
    rows of a model's scaled embedding cast the same way (its weight_scale
    rounded at each cast), and of NumPy's exact product of the scale rounded
    through the same dtypes, rounded once; float64 rows are exact."""
    raw, opened = tables
    ids = torch.arange(ROWS)
    for scale in SCALES:
        for start in (torch.bfloat16, torch.float16, torch.float32):
            module = DiskEmbedding(opened[name, scale], start, round_scale=True)
            values = torch.from_numpy(raw).view(FORMATS[name].storage)
            reference = ReferenceScaledEmbedding(values, scale, start)
            rounded = round_to(np.float64(np.float32(scale)), start)
            for what, cast in CASTS:
                cast(module), cast(reference)
                dtype = reference.weight_scale.dtype
                rounded = rounded if dtype == torch.float64 else round_to(rounded, dtype)
                assert module.dtype == dtype, what
                got = module(ids)
                assert_same_bits_but_nan(got, reference(ids))
                exact = stored_values(name, raw) * rounded
                want = exact if dtype == torch.float64 else round_to(exact, dtype)
                assert_same_bits_but_nan(got, as_torch(want, dtype))
                assert module.weight_scale.dtype == dtype, what
                assert float(module.weight_scale) == rounded, what


@pytest.mark.slow
def test_a_compiled_module_follows_its_casts(tables):
    """torch.compile of a DiskEmbedding(round_scale=True) recompiles after a
    cast, with the scale the cast gave it."""
    raw, opened = tables
    values = torch.from_numpy(raw).view(torch.float8_e4m3fn)
    module = DiskEmbedding(opened["fp8_e4m3fn", 1e-3], torch.bfloat16, round_scale=True)
    reference = ReferenceScaledEmbedding(values, 1e-3, torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True)
    ids = torch.arange(ROWS)
    for what, cast in (("as made", lambda m: m), *CASTS[:4]):  # float16, float32, bfloat16, float16
        cast(module), cast(reference)
        assert_same_bits_but_nan(compiled(ids), reference(ids))
    torch._dynamo.reset()


def test_the_casts_tell_the_scale_chain_apart(tables):
    """The chain above matters: at the issue's scale a bfloat16 module cast
    to float16 or float32 gives other rows than one made in that dtype (the
    scale rounded once)."""
    _, opened = tables
    table, ids = opened["fp8_e4m3fn", 1e-3], torch.arange(ROWS)
    for dtype in (torch.float16, torch.float32):
        cast = DiskEmbedding(table, torch.bfloat16, round_scale=True).to(dtype)
        made = DiskEmbedding(table, dtype, round_scale=True)
        assert not torch.equal(cast(ids).nan_to_num(), made(ids).nan_to_num())


def test_ngram_embedding_defaults_to_the_reference_models_arithmetic(tmp_path):
    hashing = dict(vocab_size=500, eos_id=2, base_size=40, heads_per_ngram=2)
    rows = NGramHashing(**hashing).rows
    raw = np.random.default_rng(3).integers(0, 256, (rows, 8), dtype=np.uint8)
    save_file({"ngram_embedding.shard_0.weight": torch.from_numpy(raw).view(torch.float8_e4m3fn),
               "ngram_embedding.weight_scale": torch.tensor([3e-4])},
              str(tmp_path / "t.safetensors"))
    tokens = torch.randint(3, 500, (60,), generator=torch.Generator().manual_seed(4))
    for dtype in OUTPUT_DTYPES:
        for kwargs, round_scale in (({}, True), ({"round_scale": False}, False)):
            layer = NGramEmbedding.from_safetensors(tmp_path, dtype=dtype, **hashing, **kwargs)
            with layer.table:
                assert layer.round_scale is round_scale
                assert f"round_scale={round_scale}" in repr(layer)
                ids = layer.row_ids(tokens).numpy()
                want = torch_reference("fp8_e4m3fn", raw[ids], 3e-4, dtype, round_scale)
                assert_same_bits_but_nan(layer(tokens), want.reshape(len(tokens), -1))


# --- the Triton decoder under the interpreter ------------------------------------------

@pytest.fixture(scope="module")
def interp():
    pytest.importorskip("triton")
    return load_interpreted(Path(ple.kernels.__path__[0]) / "decode_triton.py")


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("name, dtype, scale, round_scale", list(cases()))
def test_interpreted_triton_decoder_equals_the_references(interp, name, dtype, scale, round_scale):
    raw = table_bytes(seed=5)
    out = torch.empty(ROWS, COLS, dtype=dtype)
    interp.decode_rows_triton(torch.from_numpy(raw), FORMATS[name],
                              applied_scale(scale, dtype, round_scale), out)
    assert_same_bits_but_nan(out, as_torch(numpy_reference(name, raw, scale, dtype, round_scale),
                                           dtype))
    assert_same_bits_but_nan(out, torch_reference(name, raw, scale, dtype, round_scale))


# --- on a GPU ----------------------------------------------------------------------------

@needs_cuda
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("name, dtype, scale, round_scale", list(cases()))
def test_cuda_operator_equals_the_cpu_operator_and_torch_on_the_gpu(tables, name, dtype, scale,
                                                                    round_scale):
    """The Triton decoder's product against the CPU operator's, against
    NumPy, and against torch's own product on the GPU (a model's FP8Embedding
    on CUDA: ``rows.to(dtype) * weight_scale`` in torch's CUDA arithmetic)."""
    raw, opened = tables
    table = opened[name, scale]
    ids = torch.cat([torch.arange(ROWS), torch.tensor([7, 0, 39, 7])])
    got = torch.ops.ple.disk_gather(ids.cuda(), table.handle, dtype, round_scale)
    assert got.is_cuda
    assert_same_bits_but_nan(got, torch.ops.ple.disk_gather(ids, table.handle, dtype, round_scale))
    assert_same_bits_but_nan(got, as_torch(numpy_reference(name, raw[ids.numpy()], scale, dtype,
                                                           round_scale), dtype))
    assert_same_bits_but_nan(got, torch_reference(name, raw[ids.numpy()], scale, dtype, round_scale,
                                                  device="cuda"))


@needs_cuda
@pytest.mark.parametrize("name", SCALED)
def test_cuda_round_scale_follows_the_casts_of_the_module(tables, name):
    """A DiskEmbedding(round_scale=True) moved to the GPU and cast there, as
    a model's scaled embedding is: the Triton decoder's rows are torch's
    CUDA product by the scale each cast left."""
    raw, opened = tables
    ids = torch.arange(ROWS, device="cuda")
    values = torch.from_numpy(raw).view(FORMATS[name].storage)
    for scale in SCALES:
        module = DiskEmbedding(opened[name, scale], torch.bfloat16, round_scale=True).to("cuda")
        reference = ReferenceScaledEmbedding(values, scale, torch.bfloat16).to("cuda")
        assert module.weight_scale.is_cuda
        for what, cast in CASTS:
            cast(module), cast(reference)
            got = module(ids)
            assert got.is_cuda and got.dtype == reference.weight_scale.dtype, what
            assert_same_bits_but_nan(got, reference(ids))


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
def test_cuda_tiers_round_as_the_disk_rows(tmp_path, dtype):
    """Rows from the device tier, the host tier and the disk go through the
    same decode, with the same rounded scale."""
    raw = table_bytes(seed=6)
    save_file({"emb.weight": torch.from_numpy(raw).view(torch.float8_e4m3fn),
               "emb.weight_scale": torch.tensor([7.3e-5])}, str(tmp_path / "t.safetensors"))
    with ple.Table.from_safetensors(tmp_path / "t.safetensors", "emb.weight") as table:
        table.place(device_rows=10, host_rows=10, device="cuda")
        ids = torch.randint(0, ROWS, (200,), generator=torch.Generator().manual_seed(7))
        got = torch.ops.ple.disk_gather(ids.cuda(), table.handle, dtype, True)
        assert table.stats()["device_tier_hits"] > 0 and table.stats()["host_tier_hits"] > 0
        assert_same_bits_but_nan(got, torch_reference("fp8_e4m3fn", raw[ids.numpy()], 7.3e-5, dtype,
                                                      True, device="cuda"))


@needs_cuda
def test_cuda_graph_and_compile_keep_the_rounding(tables):
    raw, opened = tables
    table = opened["fp8_e4m3fn", 3e-4]
    static_ids = torch.randint(0, ROWS, (64,), generator=torch.Generator().manual_seed(8)).cuda()

    def f(ids):
        return torch.ops.ple.disk_gather(ids, table.handle, torch.bfloat16, True)

    f(static_ids)  # warm: buffers and kernels exist before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = f(static_ids)
    for seed in (9, 10):
        generator = torch.Generator().manual_seed(seed)
        static_ids.copy_(torch.randint(0, ROWS, (64,), generator=generator))
        graph.replay()
        torch.cuda.synchronize()
        want = torch_reference("fp8_e4m3fn", raw[static_ids.cpu().numpy()], 3e-4, torch.bfloat16,
                               True, device="cuda")
        assert_same_bits_but_nan(static_out, want)
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    assert_same_bits_but_nan(compiled(static_ids), f(static_ids))
    torch._dynamo.reset()
