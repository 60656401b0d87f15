"""Writes the table of a safetensors checkpoint as one GGUF tensor of a chosen
type, for ple to serve instead of the checkpoint's own (Gemma 3n's and Gemma
4's per-layer table in Q5_K takes about a third of its BF16 bytes).

    ple-quantize-table CHECKPOINT OUTPUT.gguf --type q5_k

CHECKPOINT is a directory of safetensors files (model.safetensors, or the
shards an index names) or one file; the table is the 2-D tensor (or shard
family) --tensor names, by default Gemma's per-layer table
(model.language_model.embed_tokens_per_layer.weight, or
model.embed_tokens_per_layer.weight).  Rows are read, quantized and written
a chunk at a time (--chunk-mib of float32 values) by --jobs processes, never
the whole table in memory; the GGUF file is written under a temporary name beside OUTPUT and
renamed to it when complete.  Its tensor is named as llama.cpp names the
per-layer table (per_layer_token_embd.weight; the source's own name for any
other table, or --name), so that ple.Table.from_gguf(OUTPUT, name) opens it,
and its metadata records the source (ple.source.tensor, ple.source.shape,
ple.source.dtype).  Q4_K, Q5_K and Q6_K are written by ple's own quantizer
(ple/kquants.py), the other types by gguf.quants.quantize.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING

from ple_tools.argtypes import OutputFile, positive_float, positive_int
from ple_tools.worker_pool import worker_pool

if TYPE_CHECKING:  # for annotations; imported after parsing
    import numpy as np

DEFAULT_TENSOR = "model.language_model.embed_tokens_per_layer.weight"
# llama.cpp's name of Gemma 3n's and Gemma 4's per-layer table (gguf's
# MODEL_TENSOR.PER_LAYER_TOKEN_EMBD), for a source tensor named as theirs.
PER_LAYER_TABLE = "per_layer_token_embd.weight"
PER_LAYER_SOURCE = "embed_tokens_per_layer.weight"
# The types written, by ple's row format name: those of gguf.quants.quantize
# (F32 and F16 plainly), and the K-quants of ple.kquants.
TYPES = ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "q6_k", "q5_k", "q4_k",
         "mxfp4", "tq2_0", "tq1_0")
K_TYPES = ("q4_k", "q5_k", "q6_k")
ARCHITECTURE = "ple"  # general.architecture: a table, no model
# The metadata keys of the source.
SOURCE_TENSOR = "ple.source.tensor"
SOURCE_SHAPE = "ple.source.shape"  # [rows, cols], uint64
SOURCE_DTYPE = "ple.source.dtype"  # its ple row format (ple.FORMATS)


def gguf_name(source: str) -> str:
    """The GGUF tensor name of a table whose source tensor is ``source``."""
    return PER_LAYER_TABLE if source.endswith(PER_LAYER_SOURCE) else source


def quantize_rows(values: np.ndarray, qtype: str) -> np.ndarray:
    """float32 rows ``[n, cols]`` as uint8 rows of ``qtype``."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    if qtype in K_TYPES:
        from ple.kquants import quantize_k
        return quantize_k(values, qtype)
    packed = quantize(values, GGMLQuantizationType[qtype.upper()])
    return np.ascontiguousarray(packed).view(np.uint8).reshape(values.shape[0], -1)


def _refuse(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """The source table, after argparse's usage error for every argument that
    cannot make a file: no such table, rows that are not whole blocks of the
    type, an OUTPUT that exists (without --force), is one of the source's
    files, or lies in no directory."""
    from ple.formats import BLOCK_FORMATS
    from ple.safetensors_tables import select_table

    try:
        source = select_table(args.checkpoint, args.tensor)
    except (OSError, ValueError) as error:
        parser.error(f"argument checkpoint: {error}")
    cols = source.shards[0].shape[1]
    block = BLOCK_FORMATS[args.type].block_size if args.type in BLOCK_FORMATS else 1
    if cols % block:
        parser.error(f"argument --type: {args.type} packs {block} values per block, and the rows "
                     f"of {source.name!r} have {cols} values")
    output = args.output
    if output.is_dir() or not output.parent.is_dir():
        parser.error(f"argument output: {output} is a directory, or in none: name a file to write")
    if output.exists() and any(output.samefile(s.path) for s in source.shards):
        parser.error(f"argument output: {output} holds the table itself")
    if output.exists() and not args.force:
        parser.error(f"argument output: {output} exists (--force replaces it)")
    return source


def write_table(source, output: Path, qtype: str, name: str, chunk_bytes: int,
                jobs: int = 1) -> int:
    """Writes ``source`` (a ple.safetensors_tables.SelectedTable) as tensor
    ``name`` of type ``qtype`` to the GGUF file ``output``: under a temporary
    name beside it, renamed once complete and on disk, its chunks of rows
    quantized by ``jobs`` processes.  Returns its bytes.  A progress bar on
    stderr when it is a terminal."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGML_QUANT_VERSION, GGUFValueType, GGUFWriter
    from tqdm.auto import tqdm

    from ple.formats import BLOCK_FORMATS

    fmt = source.row_format
    rows, cols = sum(s.shape[0] for s in source.shards), source.shards[0].shape[1]
    ggml_type = GGMLQuantizationType[qtype.upper()]
    out_row_bytes = (BLOCK_FORMATS[qtype].row_bytes(cols) if qtype in BLOCK_FORMATS
                     else cols * {"f32": 4, "f16": 2, "bf16": 2}[qtype])
    chunk_rows = max(1, chunk_bytes // (4 * cols))
    partial = output.with_name(f".{output.name}.partial-{os.getpid()}")
    try:
        writer = GGUFWriter(partial, ARCHITECTURE)
        writer.add_quantization_version(GGML_QUANT_VERSION)
        writer.add_string("general.quantized_by", "ple-quantize-table")
        writer.add_string(SOURCE_TENSOR, source.name)
        writer.add_key_value(SOURCE_SHAPE, [rows, cols], GGUFValueType.ARRAY,
                             sub_type=GGUFValueType.UINT64)
        writer.add_string(SOURCE_DTYPE, fmt.name)
        writer.add_tensor_info(name, (rows, out_row_bytes), np.dtype(np.uint8),
                               rows * out_row_bytes, raw_dtype=ggml_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        alignment = writer.data_alignment
        writer.close()
        with open(partial, "r+b") as out, tqdm(
                total=rows, unit="row", desc=f"{source.name} to {qtype}", file=sys.stderr,
                disable=not sys.stderr.isatty()) as bar:
            out.seek(0, os.SEEK_END)
            out.write(bytes(-out.tell() % alignment))
            done = 0
            for path, data, bad in _quantized_chunks(source, qtype, chunk_rows, jobs):
                if bad is not None:
                    raise ValueError(f"{path}: row {done + bad} of {source.name!r} holds a value "
                                     f"that is not finite, which {qtype} cannot hold")
                out.write(data)
                rows_done = len(data) // out_row_bytes
                done += rows_done
                bar.update(rows_done)
            out.flush()
            os.fsync(out.fileno())
            size = out.tell()
        os.replace(partial, output)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    _sync_directory(output.parent)
    return size


def _quantized_chunks(source, qtype: str, chunk_rows: int, jobs: int):
    """``(file, bytes, first bad row or None)`` of each chunk of
    ``chunk_rows`` rows of ``source``, in row order, quantized by ``jobs``
    processes with at most two chunks a process in flight (so memory stays
    bounded)."""
    import torch

    from ple.formats import applied_scale

    scale = applied_scale(source.scale, torch.float32, False)  # what decode_rows multiplies by
    row_bytes = source.row_format.row_bytes(source.shards[0].shape[1])
    tasks = [(str(shard.path), shard.offset + begin * row_bytes,
              min(chunk_rows, shard.shape[0] - begin), row_bytes, source.row_format.name, scale,
              qtype)
             for shard in source.shards for begin in range(0, shard.shape[0], chunk_rows)]
    if jobs <= 1 or len(tasks) <= 1:
        yield from ((task[0], *quantized_chunk(*task)) for task in tasks)
        return
    with worker_pool(min(jobs, len(tasks))) as pool:
        pending: deque = deque()
        for task in tasks:
            pending.append((task[0], pool.submit(quantized_chunk, *task)))
            if len(pending) >= 2 * jobs:
                path, future = pending.popleft()
                yield (path, *future.result())
        while pending:
            path, future = pending.popleft()
            yield (path, *future.result())


def quantized_chunk(path: str, offset: int, rows: int, row_bytes: int, fmt_name: str,
                    scale: float, qtype: str) -> tuple[bytes, int | None]:
    """``rows`` rows of ``row_bytes`` of ``path`` from byte ``offset`` (of
    ple's row format ``fmt_name``, their values times ``scale``) quantized to
    ``qtype``, and the first of them holding a value ``qtype`` cannot hold
    (not finite), else None: one process's task, which reads its rows itself."""
    import numpy as np
    import torch

    from ple.formats import FORMATS
    from ple.kernels.decode import decode_rows

    with open(path, "rb") as f:
        raw = _read(f, offset, rows * row_bytes)
    values = decode_rows(torch.frombuffer(raw, dtype=torch.uint8).view(rows, -1),
                         FORMATS[fmt_name], scale, torch.float32).numpy()
    if qtype not in ("f32", "f16", "bf16") and not np.isfinite(values).all():
        return b"", int(np.argwhere(~np.isfinite(values))[0, 0])
    return quantize_rows(values, qtype).tobytes(), None


def _read(f, offset: int, size: int) -> bytearray:
    """``size`` bytes of ``f`` from ``offset``: a short read is an error."""
    data = bytearray(size)
    view, done = memoryview(data), 0
    while done < size:
        got = os.preadv(f.fileno(), [view[done:]], offset + done)
        if got == 0:
            raise OSError(f"{f.name}: ends before byte {offset + size}")
        done += got
    return data


def _sync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def parse_args(argv=None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path,
                        help="a directory of safetensors files, or one safetensors file")
    parser.add_argument("output", action=OutputFile, help="the GGUF file to write")
    parser.add_argument("--type", choices=TYPES, default="q5_k",
                        help="the GGUF type to write (default q5_k)")
    parser.add_argument("--tensor", default=DEFAULT_TENSOR,
                        help=f"the table's tensor, or shard family prefix (default "
                        f"{DEFAULT_TENSOR}; model.<rest> also finds model.language_model.<rest>, "
                        "and the other way round)")
    parser.add_argument("--name", help="the GGUF tensor's name (default: "
                        "per_layer_token_embd.weight for a per-layer table, else the source "
                        "tensor's name)")
    parser.add_argument("--chunk-mib", type=positive_float, default=64,
                        help="float32 values of the rows quantized at a time, in MiB (default 64): "
                        "what the tool holds besides its quantizer's temporaries")
    parser.add_argument("--jobs", type=positive_int, default=len(os.sched_getaffinity(0)),
                        help="processes quantizing chunks of rows at once (default: the CPUs "
                        "this process may use)")
    parser.add_argument("--force", action="store_true", help="replace OUTPUT if it exists")
    return parser, parser.parse_args(argv)


def main(argv=None) -> int:
    parser, args = parse_args(argv)
    source = _refuse(parser, args)
    name = args.name or gguf_name(source.name)
    rows, cols = sum(s.shape[0] for s in source.shards), source.shards[0].shape[1]
    print(f"quantizing {source.name!r} ({rows:,} x {cols} {source.row_format.name}) to "
          f"{args.type}, as {name!r} in {args.output}", file=sys.stderr)
    try:
        size = write_table(source, args.output, args.type, name, int(args.chunk_mib * 2**20),
                           args.jobs)
    except (OSError, ValueError) as error:
        print(f"ple-quantize-table: error: {error}", file=sys.stderr)
        return 1
    source_bytes = rows * source.row_format.row_bytes(cols)
    print(f"wrote {args.output}: {size / 2**20:,.1f} MiB ({source_bytes / 2**20:,.1f} MiB of "
          f"{source.row_format.name} rows in the checkpoint)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
