"""Writes a table of random FP8 E4M3FN rows as sharded safetensors files, in
the layout of the reference n-gram checkpoint.

    ple-make-table data/table --mib 256     (or python tools/make_table.py ...)

The files hold ``<prefix>.shard_{i}.weight`` (i = 0..S-1) and a
``<prefix>.weight_scale`` scalar; ``layout.json`` lists them and the
arguments.  A directory that already holds a table written with the same
arguments is reused, and the tool says so; one that holds a table written
with others, or cut short, is written again.  A directory holding any file
that the table tools did not write (a model's ``model.safetensors``, say) is
refused before anything in it is deleted or written: they delete only the
files their ``layout.json`` lists.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ple_tools import written
from ple_tools.argtypes import positive_float, positive_int, refuse_empty_table, seed

if TYPE_CHECKING:  # for annotations; imported after parsing
    import numpy as np
    import torch

PREFIX = "ngram_embedding"
SCALE = 0.0078125


def random_fp8_rows(rows: int, row_bytes: int, rng: np.random.Generator) -> torch.Tensor:
    """Random FP8 rows without NaN patterns (0x7f, 0xff), as real weights are.
    (NumPy's generator: twice as fast as torch.randint's, 190 MB/s a core.)"""
    import numpy as np
    import torch

    raw = torch.from_numpy(rng.integers(0, 256, (rows, row_bytes), dtype=np.uint8))
    raw.sub_(((raw & 0x7F) == 0x7F).view(torch.uint8))  # 0x7f -> 0x7e, 0xff -> 0xfe
    return raw.view(torch.float8_e4m3fn)


def _shard_ids(rows: int, shards: int) -> list[int]:
    """The shards that get rows: of ``-(-rows // shards)`` rows each, the
    last ones may get none."""
    per_shard = -(-rows // shards)
    return [i for i in range(shards) if i * per_shard < rows]


def _file_name(f: int, files: int) -> str:
    return f"model-{f + 1:05d}-of-{files:05d}.safetensors"


def _shard_rows(i: int, rows: int, row_bytes: int, per_shard: int, seed: int) -> torch.Tensor:
    """Shard ``i``'s rows: random FP8 from a generator of its own, so that
    files can be written in any order, in parallel, with the same bytes."""
    import numpy as np

    return random_fp8_rows(min(per_shard, rows - i * per_shard), row_bytes,
                           np.random.default_rng([seed, i]))


def _write_file(directory: Path, f: int, rows: int, row_bytes: int, shards: int, files: int,
                seed: int) -> tuple[Path, int] | None:
    """Writes file ``f`` (its shards, and the scale in file 0) and fsyncs it;
    returns its path and row bytes, or None for a file that gets nothing."""
    import torch
    from safetensors.torch import save_file

    per_shard = -(-rows // shards)
    tensors = {f"{PREFIX}.shard_{i}.weight": _shard_rows(i, rows, row_bytes, per_shard, seed)
               for i in _shard_ids(rows, shards)[f::files]}
    if f == 0:
        tensors[f"{PREFIX}.weight_scale"] = torch.tensor(SCALE, dtype=torch.float32)
    if not tensors:
        return None
    path = directory / _file_name(f, files)
    save_file(tensors, str(path))
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())
    return path, sum(t.numel() for t in tensors.values() if t.dim() == 2)


def _share_cpus(writers: int) -> None:
    """A writer process's torch threads: its share of the CPUs."""
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // writers))


# A writer process pays for its start (importing torch, about 2 s) from
# about this many bytes of rows on.
WRITER_BYTES = 256 << 20


def writer_count(rows: int, row_bytes: int, files: int) -> int:
    """Processes that write a table's files: one per CPU, per file and per
    WRITER_BYTES of rows, at most (1: written in this process)."""
    return max(1, min(files, os.cpu_count() or 1, rows * row_bytes // WRITER_BYTES))


def write_table(directory: Path, *, rows: int, row_bytes: int = 160, shards: int = 8,
                files: int = 4, seed: int = 0, progress: bool | None = None,
                writers: int | None = None) -> list[Path]:
    """Writes `rows` rows in `shards` equal shards (the last one shorter) spread
    over `files` files, and fsyncs so the pages are clean (a cold benchmark
    can then drop them).  Returns the files.  Each shard's rows come from a
    generator seeded by `seed` and the shard's index.

    `writers`: processes writing files at once (None: writer_count's; 1: in
    this process).  The real n-gram table (51.2 GB in 32 files) takes about
    42 s with 16 writers on an NVMe disk, where one writer is disk-bound far
    below it.

    `progress`: a progress bar on stderr of the bytes written, file by file
    (tqdm's; None: when stderr is a terminal).  Without the bar, a line per
    file says what was written."""
    import concurrent.futures
    import multiprocessing

    from tqdm.auto import tqdm

    directory.mkdir(parents=True, exist_ok=True)
    writers = writer_count(rows, row_bytes, files) if writers is None else writers
    show = sys.stderr.isatty() if progress is None else progress
    layout = dict(rows=rows, row_bytes=row_bytes, shards=shards, files=files, seed=seed)
    written_files = {}
    with tqdm(total=rows * row_bytes, unit="B", unit_scale=True, unit_divisor=1024,
              desc=f"writing {directory.name}", file=sys.stderr, disable=not show) as bar:
        def wrote(f: int, result: tuple[Path, int] | None) -> None:
            if result is None:
                return
            path, done = written_files[f] = result
            bar.set_postfix_str(f"{path.name} [{len(written_files)}/{files}]", refresh=False)
            bar.update(done)
            if not show:
                print(f"  wrote {path.name} ({done / 2**20:.0f} MiB) "
                      f"[{len(written_files)}/{files}]", file=sys.stderr)

        if writers == 1:
            for f in range(files):
                wrote(f, _write_file(directory, f, **layout))
        else:
            # spawn: a forked copy of a process that runs torch's threads may hang
            with concurrent.futures.ProcessPoolExecutor(
                    writers, mp_context=multiprocessing.get_context("spawn"),
                    initializer=_share_cpus, initargs=(writers,)) as pool:
                jobs = {pool.submit(_write_file, directory, f, **layout): f for f in range(files)}
                for job in concurrent.futures.as_completed(jobs):
                    wrote(jobs[job], job.result())
    return [written_files[f][0] for f in sorted(written_files)]


def table_files(*, rows: int, shards: int = 8, files: int = 4, **_) -> list[str]:
    """The names of the files write_table writes: file 0 (with the scale)
    and every other file that gets a shard."""
    shard_ids = _shard_ids(rows, shards)
    return [_file_name(f, files) for f in range(files) if f == 0 or shard_ids[f::files]]


LAYOUT_FILE = "layout.json"
TOOL = "ple-make-table"
LAYOUT_KEYS = ("rows", "row_bytes", "shards", "files", "seed")


def _legacy_record(data: object) -> dict | None:
    """A record of the marker ensure_table wrote before it listed its files:
    the layout alone, written after the table's files, whose names the
    layout gives."""
    if (isinstance(data, dict) and tuple(data) == LAYOUT_KEYS
            and all(type(v) is int for v in data.values())):
        return {"complete": True, "layout": data, "files": table_files(**data)}
    return None


def ensure_table(directory: Path, *, rows: int, row_bytes: int = 160, shards: int = 8,
                 files: int = 4, seed: int = 0) -> None:
    """Writes the table unless `directory` holds one written with these very
    arguments, to the end.  Its marker, ``layout.json``, lists the files and
    says whether they were written to the end (ple_tools.written): a table
    cut short, or written with other arguments, is deleted and written
    again.  Raises ple_tools.written.ForeignFilesError, before deleting or
    writing anything, when `directory` holds any file the marker does not
    list."""
    layout = {"rows": rows, "row_bytes": row_bytes, "shards": shards, "files": files, "seed": seed}
    marker = directory / LAYOUT_FILE
    record = written.read_record(marker, TOOL, _legacy_record)
    written.refuse_foreign(directory, marker, record)
    if (record is not None and record["complete"] and record.get("layout") == layout
            and all((directory / name).is_file() for name in record["files"])):
        print(f"reusing the table in {directory} ({rows:,} rows of {row_bytes} B, "
              f"{rows * row_bytes / 2**20:.0f} MiB, seed {seed}): it was written with "
              "these arguments", file=sys.stderr)
        return
    names = table_files(**layout)
    written.begin(directory, marker, TOOL, record, names, layout=layout)
    print(f"writing a table of {rows:,} rows of {row_bytes} B "
          f"({rows * row_bytes / 2**20:.0f} MiB) in {directory}", file=sys.stderr)
    paths = write_table(directory, **layout)
    assert [p.name for p in paths] == names, (paths, names)
    written.finish(marker, TOOL, names, layout=layout)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path,
                        help="where to write the table's files: a missing or empty directory, "
                        "or one holding a table this tool wrote")
    parser.add_argument("--mib", type=positive_float, default=256,
                        help="table size in MiB (default 256)")
    parser.add_argument("--row-bytes", type=positive_int, default=160,
                        help="bytes (FP8 values) per row (default 160)")
    parser.add_argument("--shards", type=positive_int, default=8,
                        help="shards the rows are split into (default 8)")
    parser.add_argument("--files", type=positive_int, default=4,
                        help="files the shards are spread over (default 4)")
    parser.add_argument("--seed", type=seed, default=0,
                        help="seed of the random rows (default 0)")
    args = parser.parse_args(argv)
    refuse_empty_table(parser, "--mib", args.mib * 2**20, args.row_bytes)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = int(args.mib * 2**20) // args.row_bytes
    try:
        ensure_table(args.directory, rows=rows, row_bytes=args.row_bytes, shards=args.shards,
                     files=args.files, seed=args.seed)
    except written.ForeignFilesError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
