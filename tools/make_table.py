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
files their ``layout.json`` lists.  So is, before anything is written, a
table that no run can write or open: more shards than rows, more files than
shards, a header larger than ple reads, more bytes than the disk has room
for, or a file larger than the machine's memory can make.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ple_tools import written
from ple_tools.argtypes import (physical_memory, positive_float, positive_int, refuse_empty_table,
                                seed, size)
from ple_tools.worker_pool import worker_pool

if TYPE_CHECKING:  # for annotations; imported after parsing
    import numpy as np
    import torch

PREFIX = "ngram_embedding"
SCALE = 0.0078125
# The most bytes of a safetensors header that ple (and safetensors) read:
# ple.safetensors_header.MAX_HEADER_BYTES.
MAX_HEADER_BYTES = 100 * 1024 * 1024


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


# A writer process pays for its start (importing torch, about 2 s) from
# about this many bytes of rows on.
WRITER_BYTES = 256 << 20


class LayoutError(ValueError):
    """A table no run can write or open: ``what`` says which of its
    arguments to change ("shards", "files" or "size"), ``fact`` what is
    wrong, and ``advice`` (or None) how to change the shards and files."""

    def __init__(self, what: str, fact: str, advice: str | None = None):
        super().__init__(fact if advice is None else f"{fact}: {advice}")
        self.what, self.fact = what, fact


def _per_shard(rows: int, shards: int) -> int:
    return -(-rows // shards)


def _largest_file(rows: int, row_bytes: int, shards: int, files: int) -> tuple[int, int]:
    """The shards of the table's largest file (file 0: shards 0, files,
    2 * files, ...) and its bytes of rows, at most."""
    per_shard = _per_shard(rows, shards)
    filled = -(-rows // per_shard)  # the shards that get rows
    count = -(-filled // files)
    return count, count * per_shard * row_bytes


def _header_bytes(rows: int, row_bytes: int, shards: int, files: int) -> int:
    """The largest file's safetensors header, at most: its shards' entries
    with the widest numbers they can hold, the scale's, and the padding."""
    count, data = _largest_file(rows, row_bytes, shards, files)
    entry = (f'"{PREFIX}.shard_{shards - 1}.weight":{{"dtype":"F8_E4M3","shape":'
             f'[{_per_shard(rows, shards)},{row_bytes}],"data_offsets":[{data},{data}]}},')
    scale = f'"{PREFIX}.weight_scale":{{"dtype":"F32","shape":[],"data_offsets":[{data},{data}]}},'
    return 8 + 2 + count * len(entry) + len(scale) + 8


def file_memory(rows: int, row_bytes: int, shards: int, files: int) -> int:
    """The memory a writer takes for the table's largest file, at most: its
    rows, made whole before the file is written, and a shard's temporaries
    (random_fp8_rows': the bytes drawn and a mask of them)."""
    shard = _per_shard(rows, shards) * row_bytes
    return _largest_file(rows, row_bytes, shards, files)[1] + 2 * shard


def check_layout(*, rows: int, row_bytes: int, shards: int, files: int, **_) -> None:
    """Raises LayoutError for a table that cannot be written or opened: more
    shards than rows, more files than shards that get rows, or a file whose
    header ple would not read.  Arithmetic alone: nothing here counts to
    ``shards``."""
    if shards > rows:
        raise LayoutError("shards", f"{shards:,} shards for a table of {rows:,} rows: a shard "
                          "holds one row at least")
    filled = -(-rows // _per_shard(rows, shards))  # the shards that get rows
    if files > filled:
        raise LayoutError("files", f"{files:,} files for the {filled:,} shards that get rows: a "
                          "file holds one shard at least")
    header = _header_bytes(rows, row_bytes, shards, files)
    if header > MAX_HEADER_BYTES:
        raise LayoutError("shards", f"{shards:,} shards over {files:,} "
                          f"file{'' if files == 1 else 's'} make a safetensors "
                          f"header of up to {size(header)} in a file, more than the "
                          f"{size(MAX_HEADER_BYTES)} that ple reads",
                          "ask for fewer shards or more files")


def check_memory(*, rows: int, row_bytes: int, shards: int, files: int, **_) -> None:
    """Raises LayoutError for a table whose largest file cannot be made in
    this machine's memory."""
    memory, need = physical_memory(), file_memory(rows, row_bytes, shards, files)
    if need > memory:
        # A file of one shard takes three of its shards' bytes.
        more_shards = 3 * _per_shard(rows, shards) * row_bytes > memory
        raise LayoutError(
            "shards" if more_shards else "files",
            f"writing a file of the table takes up to {size(need)} of memory (its rows are made "
            f"whole before it is written), more than this machine's {size(memory)}",
            "ask for more shards, and files to spread them over" if more_shards
            else "ask for more files")


def table_bytes(*, rows: int, row_bytes: int, shards: int, files: int, **_) -> int:
    """The bytes of the table's files, at most."""
    return rows * row_bytes + files * _header_bytes(rows, row_bytes, shards, files)


def available_memory() -> int:
    """MemAvailable of /proc/meminfo in bytes (the machine's memory where
    there is none)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return physical_memory()


def writer_count(rows: int, row_bytes: int, files: int, shards: int = 1) -> int:
    """Processes that write a table's files: one per CPU, per file and per
    WRITER_BYTES of rows, and as many as the available memory holds the
    files of, at most (1: written in this process)."""
    fit = available_memory() // file_memory(rows, row_bytes, shards, files)
    return max(1, min(files, os.cpu_count() or 1, rows * row_bytes // WRITER_BYTES, fit))


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

    from tqdm.auto import tqdm

    directory.mkdir(parents=True, exist_ok=True)
    writers = writer_count(rows, row_bytes, files, shards) if writers is None else writers
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
            with worker_pool(writers) as pool:
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
WHAT = "a table"
LAYOUT_KEYS = ("rows", "row_bytes", "shards", "files", "seed")


def _legacy_record(data: object) -> dict | None:
    """A record of the marker ensure_table wrote before it listed its files:
    the layout alone, written after the table's files, whose names the
    layout gives."""
    if (isinstance(data, dict) and tuple(data) == LAYOUT_KEYS
            and all(type(v) is int for v in data.values())):
        return {"complete": True, "layout": data, "files": table_files(**data)}
    return None


def _existing(directory: Path, layout: dict) -> tuple[dict | None, bool]:
    """The record of the table in ``directory`` and whether it is this one,
    written to the end; raises, before anything is deleted or written, what
    ensure_table raises."""
    marker = directory / LAYOUT_FILE
    record = written.read_record(marker, TOOL, _legacy_record)
    written.refuse_foreign(directory, marker, record, WHAT)
    if (record is not None and record["complete"] and record.get("layout") == layout
            and all((directory / name).is_file() for name in record["files"])):
        return record, True
    check_layout(**layout)
    written.refuse_no_room(directory, table_bytes(**layout), record, WHAT)
    check_memory(**layout)
    return record, False


def ensure_table(directory: Path, *, rows: int, row_bytes: int = 160, shards: int = 8,
                 files: int = 4, seed: int = 0) -> None:
    """Writes the table unless `directory` holds one written with these very
    arguments, to the end.  Its marker, ``layout.json``, lists the files and
    says whether they were written to the end (ple_tools.written): a table
    cut short, or written with other arguments, is deleted and written
    again.  Raises, before deleting or writing anything,
    ple_tools.written.ForeignFilesError when `directory` holds any file the
    marker does not list, another ple_tools.written.DirectoryError when no
    file can be made there or its filesystem has no room for the table, and
    LayoutError for a table that cannot be written or opened."""
    layout = {"rows": rows, "row_bytes": row_bytes, "shards": shards, "files": files, "seed": seed}
    record, reuse = _existing(directory, layout)
    if reuse:
        print(f"reusing the table in {directory} ({rows:,} rows of {row_bytes} B, "
              f"{rows * row_bytes / 2**20:.0f} MiB, seed {seed}): it was written with "
              "these arguments", file=sys.stderr)
        return
    names = table_files(**layout)
    marker = directory / LAYOUT_FILE
    written.begin(directory, marker, TOOL, record, names, what=WHAT, layout=layout)
    print(f"writing a table of {rows:,} rows of {row_bytes} B "
          f"({rows * row_bytes / 2**20:.0f} MiB) in {directory}", file=sys.stderr)
    paths = write_table(directory, **layout)
    assert [p.name for p in paths] == names, (paths, names)
    written.finish(marker, TOOL, names, what=WHAT, layout=layout)


def refuse_directory(parser: argparse.ArgumentParser, directory: Path, option: str) -> None:
    """The part of refuse_table that needs no layout, for a tool that
    imports torch to know its table's rows: a directory holding files the
    table tools did not write, or a path that is a file."""
    marker = directory / LAYOUT_FILE
    try:
        written.refuse_foreign(directory, marker, written.read_record(marker, TOOL, _legacy_record),
                               WHAT)
    except written.DirectoryError as error:
        written.refuse_on_command_line(parser, error, option, option)


def refuse_table(parser: argparse.ArgumentParser, directory: Path, *, options: dict[str, str],
                 rows: int, row_bytes: int = 160, shards: int = 8, files: int = 4,
                 seed: int = 0) -> None:
    """A tool's check, once its arguments are parsed, that ensure_table can
    reuse or write this table in ``directory``: argparse's usage error
    naming the option to change (``options``: the tool's options by what
    they set, "directory" and "size", and "shards" and "files" where it has
    them; a fault of another goes to "size"), or, for a directory holding
    files the table tools did not write, that error on stderr and exit
    status 2, as the tools' command lines give it."""
    layout = {"rows": rows, "row_bytes": row_bytes, "shards": shards, "files": files, "seed": seed}
    try:
        _existing(directory, layout)
    except written.DirectoryError as error:
        written.refuse_on_command_line(parser, error, options["directory"], options["size"])
    except LayoutError as error:
        if error.what in options:
            parser.error(f"argument {options[error.what]}: {error}")
        parser.error(f"argument {options['size']}: {error.fact}: ask for a smaller table")


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
    args.rows = int(args.mib * 2**20) // args.row_bytes
    refuse_table(parser, args.directory, rows=args.rows, row_bytes=args.row_bytes,
                 shards=args.shards, files=args.files, seed=args.seed,
                 options={"directory": "directory", "size": "--mib", "shards": "--shards",
                          "files": "--files"})
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        ensure_table(args.directory, rows=args.rows, row_bytes=args.row_bytes, shards=args.shards,
                     files=args.files, seed=args.seed)
    except written.DirectoryError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
