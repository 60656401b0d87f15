"""What several test modules need: byte tables written as safetensors files,
GGUF files written with gguf's writer, Triton kernel modules loaded under the
interpreter, kernels compiled for old GPUs in a subprocess, and the ranks of
a process group run as processes."""

from __future__ import annotations

import ctypes
import importlib.util
import json
import mmap
import os
import re
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import ple
from ple_tools.ranks import run_ranks as run_commands

REPO = Path(__file__).resolve().parents[1]
PAGE = os.sysconf("SC_PAGESIZE")


@dataclass
class ByteTable:
    """A U8 table (a row's values are its bytes) and where its rows lie in
    its files, read from the headers without ple."""
    table: ple.Table
    reference: np.ndarray  # [num_rows, row_bytes] uint8
    row_file: np.ndarray  # index of each row's file in the table's files
    row_offset: np.ndarray  # byte offset of each row in its file

    @property
    def row_bytes(self) -> int:
        return self.reference.shape[1]

    def expected_pages(self, ids) -> int:
        """Distinct PAGE-sized file pages under the rows ``ids``."""
        pages = set()
        for i in np.unique(np.asarray(ids).reshape(-1)).tolist():
            f, offset = int(self.row_file[i]), int(self.row_offset[i])
            pages.update((f, p) for p in range(offset // PAGE, (offset + self.row_bytes - 1) // PAGE + 1))
        return len(pages)


def resident_pages(path, start: int = 0, end: int | None = None) -> int:
    """Pages of the file's bytes [start, end) in the page cache: mincore over
    a private mapping of them (which maps the cached pages without reading
    any)."""
    libc = ctypes.CDLL(None, use_errno=True)
    end = os.path.getsize(path) if end is None else end
    first_page = start // PAGE * PAGE
    size = end - first_page
    vec = (ctypes.c_ubyte * ((size + PAGE - 1) // PAGE))()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY,
                                          offset=first_page) as mapped:
        first = ctypes.c_char.from_buffer(mapped)
        try:
            assert libc.mincore(ctypes.c_void_p(ctypes.addressof(first)), ctypes.c_size_t(size),
                                vec) == 0, os.strerror(ctypes.get_errno())
        finally:
            del first
    return sum(v & 1 for v in vec)


def run_threads(worker: Callable[[int], None], n: int) -> None:
    """Runs ``worker(k)`` for k in range(n), each on a thread of its own, and
    waits for them all."""
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def close_while_threads_gather(table: ple.Table, reference: np.ndarray, threads: int = 4) -> None:
    """Closes ``table`` while ``threads`` threads gather random rows from it
    (up to 50 gathers each): each thread must either finish with the right
    bytes or be told that the table is closed, naming its handle."""
    handle = table.handle
    outcomes, start = [], threading.Event()

    def gather_until_closed(k: int) -> None:
        start.wait()
        ids = torch.from_numpy(np.random.default_rng(k).integers(0, len(reference), 20000))
        for _ in range(50):
            try:
                rows = torch.ops.ple.disk_gather_bytes(ids, handle)
            except ValueError as error:  # closed: the handle is gone
                outcomes.append(str(error))
                return
            except Exception as error:  # noqa: BLE001 (reported by the assertion below)
                outcomes.append(repr(error))
                return
            if not np.array_equal(rows.numpy(), reference[ids.numpy()]):
                outcomes.append("wrong bytes")
                return
        outcomes.append("finished")

    workers = [threading.Thread(target=gather_until_closed, args=(k,)) for k in range(threads)]
    for worker in workers:
        worker.start()
    start.set()
    table.close()
    for worker in workers:
        worker.join(timeout=120)
    assert not any(worker.is_alive() for worker in workers), "a gather did not end after close()"
    assert len(outcomes) == threads
    assert all(o == "finished" or (f"handle {handle}" in o and "closed" in o)
               for o in outcomes), outcomes


def tensor_offsets(path: Path) -> dict[str, int]:
    """File offset of each tensor's first byte, from the header: an 8-byte
    little-endian length, the JSON, then the data."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {name: 8 + length + info["data_offsets"][0]
            for name, info in header.items() if name != "__metadata__"}


def write_byte_table(paths: list[Path], shard_rows: list[int], row_bytes: int, *, seed: int,
                     shard_file: list[int] | None = None, pads: tuple[int, ...] = (),
                     family: bool = True, tensor: str | None = None,
                     config: ple.GatherConfig | None = None) -> ByteTable:
    """Random U8 shards of ``shard_rows`` rows, shard i in
    ``paths[shard_file[i]]`` (by default they alternate), as the shard family
    ``t.shard_{i}.weight`` or, with ``family=False``, as one tensor ``t``.
    File f also holds a 1-D ``pad{f}`` tensor of ``pads[f]`` bytes (none when
    0 or absent) that moves the rows off page alignment.  A file that would
    hold no rows is not written.  Files are fsynced: written pages are dirty,
    and drop_page_cache could not make the table cold.  Opened with
    ``tensor`` and ``config``."""
    rng = np.random.default_rng(seed)
    shards = [rng.integers(0, 256, (n, row_bytes), dtype=np.uint8) for n in shard_rows]
    names = [f"t.shard_{i}.weight" for i in range(len(shards))] if family else ["t"]
    assert len(names) == len(shards), "one shard unless it is a family"
    if shard_file is None:
        shard_file = [i % len(paths) for i in range(len(shards))]
    contents: list[dict[str, torch.Tensor]] = [{} for _ in paths]
    for f, pad in enumerate(pads):
        if pad:
            contents[f][f"pad{f}"] = torch.from_numpy(rng.integers(0, 256, pad, dtype=np.uint8))
    for name, shard, f in zip(names, shards, shard_file):
        contents[f][name] = torch.from_numpy(shard)
    written, where = [], {}
    for path, tensors in zip(paths, contents):
        if not any(not name.startswith("pad") for name in tensors):
            continue
        save_file(tensors, str(path))
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        for name, offset in tensor_offsets(path).items():
            where[name] = (len(written), offset)
        written.append(path)
    row_file, row_offset = [], []
    for name, n in zip(names, shard_rows):
        f, start = where[name]
        row_file += [f] * n
        row_offset += [start + r * row_bytes for r in range(n)]
    table = ple.Table.from_safetensors(written, tensor, config)
    return ByteTable(table, np.concatenate(shards), np.array(row_file, dtype=np.int64),
                     np.array(row_offset, dtype=np.int64))


def write_sharded_table(directory: Path, shard_rows: tuple[int, ...], row_bytes: int, *,
                        seed: int | None = None, config=None) -> ByteTable:
    """The shard family ``t.shard_{i}.weight`` of ``shard_rows`` rows of
    ``row_bytes`` random bytes (seeded with ``seed``, else ``row_bytes``):
    even shards in ``directory``/a.safetensors, odd ones in b.safetensors,
    behind pads of 13 and 1001 bytes, so that rows straddle pages, shards and
    files."""
    return write_byte_table([directory / "a.safetensors", directory / "b.safetensors"],
                            list(shard_rows), row_bytes, seed=row_bytes if seed is None else seed,
                            pads=(13, 1001), config=config)


def write_random_rows(path: Path, rows: int = 50_000, row_bytes: int = 160) -> np.ndarray:
    """A table ``t`` of ``rows`` rows of ``row_bytes`` random bytes (seed 0)
    at ``path``; returns its rows."""
    reference = np.random.default_rng(0).integers(0, 256, (rows, row_bytes), dtype=np.uint8)
    save_file({"t": torch.from_numpy(reference)}, str(path))
    return reference


def write_arange_table(path: Path, rows: int, cols: int, name: str = "t") -> Path:
    """A float32 table whose row i holds i * cols .. i * cols + cols - 1."""
    save_file({name: torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)}, str(path))
    return path


def random_fp8_bytes(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Random uint8 bytes of ``shape`` from ``rng``, none of them an FP8
    e4m3fn NaN (S.1111.111), so that decoded outputs compare with ==."""
    raw = rng.integers(0, 256, shape, dtype=np.uint8)
    raw[(raw & 0x7F) == 0x7F] ^= 1  # the next pattern down: the largest finite magnitude
    return raw


def write_fp8_table(path: Path, rows: int = 5000, seed: int = 0) -> Path:
    """A table of 160 B FP8 rows of random bytes (none NaN, so that outputs
    compare with ==) and a scale of 0.5."""
    raw = torch.from_numpy(random_fp8_bytes(np.random.default_rng(seed), (rows, 160)))
    save_file({"t": raw.view(torch.float8_e4m3fn), "t_scale": torch.tensor(0.5)}, str(path))
    return path


def write_gguf(path, tensors: dict) -> None:
    """A GGUF file of ``{name: (data, GGMLQuantizationType)}``; F32 and F16
    data are numpy arrays of values, other types raw block bytes."""
    writer = gguf.GGUFWriter(str(path), "test")
    for name, (data, qtype) in tensors.items():
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# Where the f16 scales of each GGUF block format lie in its block (gguf/quants.py's
# layouts), as byte offsets; IQ1_M's is split into the top nibbles of the four
# uint16 from byte 48, its lowest nibble first; MXFP4 and NVFP4 have byte
# scales, every one finite.
GGUF_F16_SCALES = {"q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q8_0": (0,),
                   "q2_k": (80, 82), "q3_k": (108,), "q4_k": (0, 2), "q5_k": (0, 2),
                   "q6_k": (208,), "iq2_xxs": (0,), "iq2_xs": (0,), "iq3_xxs": (0,), "iq1_s": (0,),
                   "iq4_nl": (0,), "iq3_s": (0,), "iq2_s": (0,), "iq4_xs": (0,), "iq1_m": (48,),
                   "tq1_0": (52,), "tq2_0": (64,), "mxfp4": (), "nvfp4": ()}
# Finite f16 scales worth having: 0, -0, smallest and largest subnormals, smallest
# normal, largest finite, 1, -1.
F16_SPECIAL_BITS = (0x0000, 0x8000, 0x0001, 0x83FF, 0x0400, 0x7BFF, 0xFBFF, 0x3C00, 0xBC00)


def random_f16_bits(rng: np.random.Generator, shape) -> np.ndarray:
    """Random finite f16 bit patterns: an all-ones exponent (inf/nan) loses its top bit."""
    bits = rng.integers(0, 1 << 16, shape, dtype=np.uint16)
    return np.where((bits & 0x7C00) == 0x7C00, bits & 0xBFFF, bits).astype(np.uint16)


def random_gguf_blocks(name: str, n: int, rng: np.random.Generator,
                       specials=F16_SPECIAL_BITS) -> np.ndarray:
    """uint8 ``[n, block_bytes]``: ``n`` blocks of the GGUF block format ``name``
    of random bytes, but for their f16 scales: random finite ones after
    ``specials`` (each scale of a block its own rotation of them).  For the
    types gguf cannot quantize to."""
    from ple.formats import BLOCK_FORMATS

    raw = rng.integers(0, 256, (n, BLOCK_FORMATS[name].block_bytes), dtype=np.uint8)
    for i, offset in enumerate(GGUF_F16_SCALES[name]):
        bits = random_f16_bits(rng, n)
        rolled = np.roll(np.array(specials, dtype=np.uint16), i)[:n]
        bits[:rolled.size] = rolled
        if name == "iq1_m":
            for byte in range(4):
                nibble = ((bits >> (4 * byte)) & 15).astype(np.uint8)
                at = offset + 2 * byte + 1
                raw[:, at] = (raw[:, at] & 15) | (nibble << 4)
        else:
            raw[:, offset:offset + 2] = bits.view(np.uint8).reshape(-1, 2)
    return raw


def load_module(name: str, path: Path) -> ModuleType:
    """The Python file at ``path`` as a fresh module named ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The Triton modules each kernel module imports kernels from: they are
# loaded interpreted with it, since an interpreted kernel cannot call a
# compiled one.
KERNEL_IMPORTS = {"decode_triton": ("tier_rows_triton",),
                  "decode_gguf_triton": ("tier_rows_triton", "decode_triton", "gguf_bits_triton",
                                         "decode_gguf_k_triton", "decode_gguf_iq_triton")}


def load_interpreted(path: Path) -> ModuleType:
    """The kernel module at ``path``, loaded under a private name with
    TRITON_INTERPRET=1, so that its kernels run on CPU tensors.  The variable
    is read when ``@triton.jit`` decorates a function, so it is set for the
    load only: the operators' own copies of the kernels stay compiled.  The
    kernel modules it imports from (KERNEL_IMPORTS) are loaded interpreted
    too and stand in for ``ple.kernels.<name>`` while it loads; the real ones
    are imported first and put back after, so that no import of the
    operators binds an interpreted kernel (on a GPU that fails to compile)."""
    dependencies = {f"ple.kernels.{name}": path.parent / f"{name}.py"
                    for name in KERNEL_IMPORTS.get(path.stem, ())}
    real = {name: importlib.import_module(name) for name in dependencies}
    old_env = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        for name, dependency in dependencies.items():
            sys.modules[name] = load_module(f"_interpreted_{Path(dependency).stem}_for_{path.stem}", dependency)
        return load_module(f"_interpreted_{path.stem}", path)
    finally:
        sys.modules.update(real)
        if old_env is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old_env


# Integer views of float tensors, by element size: comparisons to the bit.
INT_VIEW = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def take_rows(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``values[ids]``, indexed through an integer view of the same width:
    torch 2.9 does not index float8 tensors on the CPU ('"index_cpu" not
    implemented for 'Float8_e4m3fn''), and the bits come out the same."""
    if not values.dtype.is_floating_point:
        return values[ids]
    return values.view(INT_VIEW[values.element_size()])[ids].view(values.dtype)


def bits(values: torch.Tensor) -> torch.Tensor:
    """The values' bit patterns, so that NaN equals NaN and -0.0 differs from 0.0."""
    return values.view(INT_VIEW[values.element_size()])


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(bits(got.cpu()), bits(want.cpu()))


def assert_same_bits_but_nan(got: torch.Tensor, want: torch.Tensor) -> None:
    """assert_same_bits where NaN need only be NaN: a NaN's sign and payload
    follow each device's arithmetic (the fp8 tables hold NaN bytes; the GPU's
    multiply by the scale returns its own NaN)."""
    got, want = got.cpu(), want.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan), "NaN in different places"
    mismatch = (bits(got) != bits(want)) & ~nan  # -0.0 against 0.0 and inf included
    assert not mismatch.any(), (
        f"{int(mismatch.sum())} bit mismatches, first at {mismatch.nonzero()[0].tolist()}: "
        f"{got[mismatch][:4].tolist()} vs {want[mismatch][:4].tolist()}")
# The targets the Triton kernels must compile for (V100, Turing, A100, H100),
# and the output dtypes by their Triton signature names.
COMPILE_CCS = (70, 75, 80, 90)
OUT_SIGNATURE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def dtype_id(d: torch.dtype | None) -> str:
    """A test id for a dtype (None: the table's default)."""
    return "default" if d is None else str(d).removeprefix("torch.")


def compile_for_targets(script: str, names, cache_dir: Path) -> dict:
    """compile_in_subprocess of every (target, format name, output dtype)."""
    return compile_in_subprocess(script, [COMPILE_CCS, list(names), list(OUT_SIGNATURE.values())],
                                 cache_dir)


# What every compile script starts with: ``compile_summary(src, cc, options)``, a
# kernel compiled for sm_cc summarized as JSON (its PTX and cubin, or the
# error), and the decoders' arguments of a call without tiers.
COMPILE_PRELUDE = r"""
import json, sys, triton
from triton.backends.compiler import GPUTarget

def compile_summary(src, cc, options=None):
    try:
        k = triton.compile(src, target=GPUTarget("cuda", cc, 32), options=options or {})
        return {"ptx": k.asm["ptx"], "cubin_head": k.asm["cubin"][:4].hex(),
                "cubin_len": len(k.asm["cubin"])}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"[-3000:]}

# Staged rows and a status word, no tiers (their variants: test_tier_rows_triton.py).
NO_TIERS_SIGNATURE = {"ids_ptr": "*u8", "device_ptr": "*u8", "host_ptr": "*u8", "first_row": "i32",
                      "device_rows": "i32", "tier_rows": "i32", "num_rows": "i32", "hits_ptr": "*u8",
                      "report_ptr": "*u8"}
NO_TIERS_CONSTEXPRS = {"TIERS": False, "HAS_STATUS": True, "SCAN_IDS": 0}
"""


def compile_in_subprocess(script: str, args: list, cache_dir: Path) -> dict:
    """Runs ``script`` after COMPILE_PRELUDE (it compiles kernels with
    ``compile_summary`` and prints a JSON object as its last line) with ``args`` as
    JSON arguments, in a subprocess: the kernel module must be imported
    there without TRITON_INTERPRET, and a fresh cache makes it really
    compile."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    proc = subprocess.run([sys.executable, "-c", COMPILE_PRELUDE + script,
                           *(json.dumps(a) for a in args)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_runs_on_old_gpus(result: dict, cc: int) -> None:
    """A kernel compiled for sm_``cc``: PTX for that target and an ELF cubin,
    with no fp8 conversion (SM89+), no bf16 one (the kernels round to bf16
    with integer operations, the same on every target) and no flush to zero
    (subnormals must survive).  Skips a target the installed ptxas does not
    know: CUDA 13's ptxas (torch's cu13 wheels) has no sm_70."""
    unknown = re.search(rf"Value 'sm_{cc}a?' is not defined for option 'gpu-name'.*?Repro command: (\S+)",
                        result.get("error", ""), re.DOTALL)
    if unknown:
        pytest.skip(f"{unknown.group(1)} cannot build sm_{cc}")
    assert "error" not in result, result.get("error")
    ptx = result["ptx"]
    assert re.search(rf"^\.target sm_{cc}a?\b", ptx, re.MULTILINE)  # Triton targets sm_90a on SM90
    assert result["cubin_head"] == "7f454c46" and result["cubin_len"] > 0
    assert not re.search(r"\bcvt\.[\w.]*(e4m3|e5m2)", ptx)
    assert not re.search(r"\bcvt\.[\w.]*bf16", ptx)
    assert ".ftz" not in ptx


def run_ranks(script: Path, args: list[str], world_size: int, timeout_s: float, logs: Path,
              env: dict[str, str] | None = None) -> None:
    """Runs ``python script *args RANK WORLD_SIZE`` for every rank at once
    (``ple_tools.ranks``: a failed rank or the timeout ends them all) and
    fails the test with every rank's output unless all exit 0."""
    run = run_commands([[sys.executable, str(script), *args, str(rank), str(world_size)]
                        for rank in range(world_size)], timeout_s, logs, env)
    if not run.ok:
        pytest.fail(run.describe(), pytrace=False)


def directory_bytes(directory: Path) -> dict[str, bytes | None]:
    """Everything under ``directory`` by relative path: a file's bytes, None
    for a directory; to check that a tool left it as it was."""
    return {str(p.relative_to(directory)): p.read_bytes() if p.is_file() else None
            for p in sorted(directory.rglob("*"))}


def save_a_model(directory: Path) -> None:
    """``model.safetensors`` as transformers' save_pretrained names it, and
    a note beside it: what a user's directory may hold."""
    directory.mkdir(parents=True, exist_ok=True)
    save_file({"lm_head.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4)},
              str(directory / "model.safetensors"))
    (directory / "notes.txt").write_text("my fine-tuned model\n")


def foreign_files_message(directory: Path, names: list[str], marker: str = "layout.json") -> str:
    """The error ple_tools.written gives for a directory holding ``names``
    (sorted; at most three named)."""
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    one = len(names) == 1
    return (f"{directory} holds {len(names)} file{'' if one else 's'} that ple did not write "
            f"({shown}); ple writes its files only into a missing or empty directory, or one "
            f"holding files it wrote there itself (listed in its {marker}), and deletes nothing "
            f"else: name another directory, or move {'that file' if one else 'those files'} out")


@pytest.fixture(autouse=True, scope="module")
def quiet_transformers():
    """transformers' warnings and progress bars off for a module's tests (an
    autouse fixture for the modules that import it)."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    yield
    transformers.logging.set_verbosity(verbosity)
    transformers.utils.logging.enable_progress_bar()
