"""Where a table's rows lie in its files, as the library opened them: the
shards' files and offsets, and the 4 KiB file pages under a set of rows (what
the benchmarks' NumPy baselines and O_DIRECT reads need)."""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import ple
from ple.safetensors_tables import select_table

PAGE = mmap.PAGESIZE


def shard_entries(table: ple.Table) -> list:
    """The safetensors entries of the table's shards in row order (file, byte
    offset, shape): the library's own choice of them (select_table, which
    ple.Table.from_safetensors opens), read again from the table's files."""
    shards = select_table(table.paths, table.name).shards
    if [s.shape[0] for s in shards] != table.shard_rows:
        raise ValueError(f"{table.name}: its files now hold shards of {[s.shape[0] for s in shards]} "
                         f"rows, not the table's {table.shard_rows}")
    return shards


@dataclass
class Layout:
    """A table's shards: their files (``paths``, ple.Table's order), each
    shard's file index, byte offset and rows, and the row size."""
    paths: list[Path]
    shard_file: np.ndarray  # int64, per shard: index into paths
    shard_offset: np.ndarray  # int64, per shard: offset of its first row in its file
    shard_rows: list[int]
    row_bytes: int

    @classmethod
    def of(cls, table: ple.Table) -> "Layout":
        shards = shard_entries(table)
        file_index = {path: i for i, path in enumerate(table.paths)}
        return cls(paths=list(table.paths),
                   shard_file=np.array([file_index[s.path] for s in shards], dtype=np.int64),
                   shard_offset=np.array([s.offset for s in shards], dtype=np.int64),
                   shard_rows=list(table.shard_rows), row_bytes=table.row_bytes)

    @classmethod
    def open(cls, paths, tensor: str | None = None) -> "Layout":
        """The layout of the table ``ple.Table.from_safetensors(paths, tensor)``
        opens (the table is closed again)."""
        with ple.Table.from_safetensors(paths, tensor) as table:
            return cls.of(table)

    @property
    def shard_starts(self) -> np.ndarray:
        return np.cumsum([0] + self.shard_rows)

    @property
    def num_rows(self) -> int:
        return int(sum(self.shard_rows))

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(shard, file index, byte offset in the file) of each id."""
        starts = self.shard_starts
        shard = np.searchsorted(starts, ids, side="right") - 1
        local = ids - starts[shard]
        return shard, self.shard_file[shard], self.shard_offset[shard] + local * self.row_bytes

    def pages(self, ids: np.ndarray) -> np.ndarray:
        """The distinct 4 KiB pages under the rows, as sorted keys file << 40 | page."""
        _, file, offset = self.locate(ids)
        first, last = offset // PAGE, (offset + self.row_bytes - 1) // PAGE
        keys = [(file << 40) | first]
        span = int((last - first).max(initial=0))
        keys += [(file << 40) | np.minimum(first + k, last) for k in range(1, span + 1)]
        return np.unique(np.concatenate(keys))
