"""Tables: row-major embedding tables that stay in their checkpoint files."""

from __future__ import annotations

import errno
import os
import re
import threading
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Union

import torch

from .kernels.native import native

from .config import GatherConfig
from .files import open_regular_binary
from .formats import BY_GGUF_TYPE, BY_SAFETENSORS_DTYPE, RowFormat
from .gguf_header import read_gguf_tensors
from .safetensors_header import TensorEntry, read_header
from .staging import StreamStaging
from .tiers import Placement

PathsLike = Union[str, os.PathLike, Iterable[Union[str, os.PathLike]]]

# ASCII digits only (\d would take other scripts' digits, which int() reads);
# an index with leading zeros matches, to be refused by _shard_families.
SHARD_NAME = re.compile(r"^(?P<prefix>.+)\.shard_(?P<index>[0-9]+)\.weight$")
# A row wider than this cannot be in any file: only a table of no rows could
# claim it, and the native code counts bytes in int64.
MAX_ROW_BYTES = 1 << 48
SCALE_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}

# Open tables by handle, for the operators; a table that is dropped closes.
_open_tables: "weakref.WeakValueDictionary[int, Table]" = weakref.WeakValueDictionary()
# What tables closed in a forked child held of their parent's CUDA state (pinned
# buffers, streams, tiers): the child can neither use nor free it, so it stays.
_left_to_the_parent: list = []
# The names of the last tables opened, by handle (handles are never reused), so
# that a call with the handle of a closed table can say which table it was.
_names_by_handle: dict[int, str] = {}
MAX_NAMES_KEPT = 4096
COMPILED_HINT = ("a table must stay open while code that gathers from it runs, compiled code "
                 "and captured CUDA graphs included")


def table_for_handle(handle: int) -> "Table":
    table = _open_tables.get(handle)
    if table is None:
        name = _names_by_handle.get(handle)
        if name is not None:
            raise ValueError(f"ple table {name!r} (handle {handle}) is closed: {COMPILED_HINT}")
        raise ValueError(f"no open ple table has handle {handle} (closed, or never opened)")
    return table


def _remember_name(handle: int, name: str) -> None:
    _names_by_handle[handle] = name
    while len(_names_by_handle) > MAX_NAMES_KEPT:
        del _names_by_handle[next(iter(_names_by_handle))]  # the oldest


def _resolve_paths(paths: PathsLike) -> list[Path]:
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    files: list[Path] = []
    for item in items:
        path = Path(item)
        if path.is_dir():
            found = sorted(path.glob("*.safetensors"))
            if not found:
                raise FileNotFoundError(errno.ENOENT, "no *.safetensors files in directory", str(path))
            files.extend(found)
        elif path.exists():
            files.append(path)
        else:
            raise FileNotFoundError(errno.ENOENT, "no such table file", str(path))
    if not files:
        raise ValueError("no table files given")
    return files


def _read_entries(files: list[Path]) -> dict[str, TensorEntry]:
    entries: dict[str, TensorEntry] = {}
    for path in files:
        for name, entry in read_header(path).items():
            if name in entries:
                raise ValueError(f"tensor {name!r} is in both {entries[name].path} and {path}")
            entries[name] = entry
    return entries


def read_checkpoint_entries(paths: PathsLike) -> dict[str, TensorEntry]:
    """Every tensor of safetensors files (a file, a list of files or a
    directory of ``*.safetensors``) by name, from their headers alone."""
    return _read_entries(_resolve_paths(paths))


def _shard_families(entries: dict[str, TensorEntry]) -> dict[str, dict[int, TensorEntry]]:
    """The shard families by prefix.  A shard index written with leading zeros
    (``x.shard_01.weight``) is a ValueError naming the file and the tensor."""
    families: dict[str, dict[int, TensorEntry]] = {}
    for name, entry in entries.items():
        match = SHARD_NAME.match(name)
        if match:
            family = families.setdefault(match["prefix"], {})
            index = int(match["index"])
            if match["index"] != str(index):
                raise ValueError(
                    f"{entry.path}: tensor {name!r}: shard index {match['index']!r} has leading "
                    f"zeros; shard {index} of {match['prefix']!r} must be named "
                    f"'{match['prefix']}.shard_{index}.weight'")
            if index in family:
                raise ValueError(f"{entry.path}: {name!r} and {family[index].name!r} "
                                 f"({family[index].path}) are both shard {index}")
            family[index] = entry
    return families


def _select(entries, families, tensor, files) -> tuple[str, list[TensorEntry], str]:
    """The chosen table: its name, its shards in row order, its scale tensor's name."""
    where = ", ".join(str(f) for f in files)
    if tensor is None:
        in_family = {e.name for family in families.values() for e in family.values()}
        candidates = [f"{p}.shard_*" for p in sorted(families)] + sorted(
            name for name, e in entries.items() if len(e.shape) == 2 and name not in in_family)
        if len(candidates) != 1:
            raise ValueError(f"{where}: {len(candidates)} candidate tables {candidates}; "
                             "pass tensor= to choose one")
        tensor = candidates[0].removesuffix(".shard_*")
    if tensor in families and tensor in entries:
        raise ValueError(f"{where}: {tensor!r} names both a tensor and a shard family")
    if tensor in families:
        family = families[tensor]
        indices = sorted(family)
        missing = next((i for i, index in enumerate(indices) if index != i), None)
        if missing is not None:
            shown = indices if len(indices) <= 20 else [*indices[:20], "..."]
            raise ValueError(f"{where}: shard gap in {tensor!r}: shard {missing} is missing "
                             f"(found shards {shown})")
        return tensor, [family[i] for i in range(len(family))], f"{tensor}.weight_scale"
    if tensor in entries:
        # One shard of a family is scaled by the family's scale.
        shard = SHARD_NAME.match(tensor)
        return tensor, [entries[tensor]], (f"{shard['prefix']}.weight_scale" if shard
                                           else f"{tensor}_scale")
    raise ValueError(f"{where}: no tensor or shard family named {tensor!r}")


def _check_shards(name: str, shards: list[TensorEntry]) -> None:
    first = shards[0]
    for shard in shards:
        if len(shard.shape) != 2:
            raise ValueError(f"{shard.path}: tensor {shard.name!r} of {name!r} is not 2-D "
                             f"(shape {list(shard.shape)})")
        if shard.dtype != first.dtype or shard.shape[1] != first.shape[1]:
            raise ValueError(
                f"{shard.path}: tensor {shard.name!r} is {shard.dtype} {list(shard.shape)}, but "
                f"{first.name!r} in {first.path} is {first.dtype} {list(first.shape)}: shards of "
                "one table need the same dtype and width")
    for shard in shards[1:-1]:
        if shard.shape[0] != first.shape[0]:
            raise ValueError(
                f"{shard.path}: tensor {shard.name!r} has {shard.shape[0]} rows, but "
                f"{first.name!r} has {first.shape[0]}: every shard but the last has the same rows")
    last = shards[-1]
    if len(shards) > 1 and last.shape[0] > first.shape[0]:
        raise ValueError(f"{last.path}: last shard {last.name!r} has {last.shape[0]} rows, more "
                         f"than {first.name!r} ({first.shape[0]})")
    if first.dtype not in BY_SAFETENSORS_DTYPE:
        raise ValueError(f"{first.path}: tensor {first.name!r}: dtype {first.dtype} is not a "
                         f"supported row format ({', '.join(BY_SAFETENSORS_DTYPE)})")
    if first.shape[1] == 0:
        raise ValueError(f"{first.path}: tensor {first.name!r} has rows of no values")
    _check_row_bytes(f"{first.path}: tensor {first.name!r}",
                     BY_SAFETENSORS_DTYPE[first.dtype].row_bytes(first.shape[1]))


def _check_row_bytes(tensor: str, row_bytes: int) -> None:
    if row_bytes > MAX_ROW_BYTES:
        raise ValueError(f"{tensor} has rows of {row_bytes} bytes, more than {MAX_ROW_BYTES}")


def _read_scale(entry: TensorEntry, given: float | None) -> float:
    """The value of a scale tensor; `given`, a caller's scale, must agree with
    it once rounded to the tensor's dtype."""
    if entry.dtype not in SCALE_DTYPES or entry.nbytes != SCALE_DTYPES[entry.dtype].itemsize:
        raise ValueError(f"{entry.path}: scale tensor {entry.name!r} must hold one F32, F16 or "
                         f"BF16 value, not {entry.dtype} {list(entry.shape)}")
    with open_regular_binary(entry.path) as f:
        f.seek(entry.offset)
        raw = bytearray(f.read(entry.nbytes))
    value = torch.frombuffer(raw, dtype=SCALE_DTYPES[entry.dtype]).item()
    if given is not None and torch.tensor(given, dtype=SCALE_DTYPES[entry.dtype]).item() != value:
        raise ValueError(f"{entry.path}: {entry.name!r} is {value}, but scale={given} was given")
    return value


class Table:
    """A table whose rows stay in their files, read by ``torch.ops.ple`` operators.

    Open one with :meth:`from_safetensors` or :meth:`from_gguf`.  ``handle``
    is the int the operators take.  Close it (or use it as a context manager)
    to unmap its files.
    """

    def __init__(self, name: str, shards: list[TensorEntry], fmt: RowFormat, scale: float,
                 config: GatherConfig):
        self.name = name
        self.format = fmt.name
        self.row_format = fmt
        self.scale = scale
        self.cols = shards[0].shape[1]
        self.row_bytes = fmt.row_bytes(self.cols)
        self.num_rows = sum(s.shape[0] for s in shards)
        self.shard_rows = [s.shape[0] for s in shards]
        self.paths = list(dict.fromkeys(s.path for s in shards))
        file_index = {path: i for i, path in enumerate(self.paths)}
        self._staging: dict[tuple[int, int], StreamStaging] = {}
        self.placement: Placement | None = None
        self._retired_placements: list[Placement] = []
        self._handle = native.open_table(
            [str(p) for p in self.paths], [file_index[s.path] for s in shards],
            [s.offset for s in shards], self.shard_rows, self.row_bytes)
        self._config = config
        self._push_config(config)
        _open_tables[self._handle] = self
        _remember_name(self._handle, name)

    @classmethod
    def from_safetensors(cls, paths: PathsLike, tensor: str | None = None,
                         config: GatherConfig | None = None, *, scale: float | None = None
                         ) -> "Table":
        """Opens a table from safetensors files without reading its rows.

        ``paths``: a file, a list of files, or a directory of ``*.safetensors``.
        ``tensor``: a 2-D tensor's name, or the prefix of a shard family
        ``<prefix>.shard_{i}.weight``; optional when there is only one.
        ``scale``: multiplies fp8/u8/i8 values when the files hold no
        ``<prefix>.weight_scale`` / ``<tensor>_scale`` tensor.
        """
        files = _resolve_paths(paths)
        entries = _read_entries(files)
        name, shards, scale_name = _select(entries, _shard_families(entries), tensor, files)
        _check_shards(name, shards)
        fmt = BY_SAFETENSORS_DTYPE[shards[0].dtype]
        if not fmt.scaled and (scale is not None or scale_name in entries):
            raise ValueError(f"{shards[0].path}: {name!r} holds {fmt.name} rows, which are not "
                             "scaled; scales apply to fp8_e4m3fn, u8 and i8 rows")
        file_scale = _read_scale(entries[scale_name], scale) if scale_name in entries else None
        resolved = file_scale if file_scale is not None else 1.0 if scale is None else float(scale)
        return cls(name, shards, fmt, resolved, config or GatherConfig())

    @classmethod
    def from_gguf(cls, path: str | os.PathLike, tensor: str,
                  config: GatherConfig | None = None) -> "Table":
        """Opens one 2-D tensor of a GGUF file as a table without reading its
        rows: F32, F16, BF16, or the block formats Q8_0, Q4_0, IQ4_NL, Q4_K and
        Q6_K, kept packed and decoded only for the rows gathered."""
        path = Path(path)
        entries = read_gguf_tensors(path)
        if tensor not in entries:
            candidates = sorted(n for n, e in entries.items() if len(e.shape) == 2)
            raise ValueError(f"{path}: no tensor named {tensor!r}; 2-D tensors: {candidates}")
        entry = entries[tensor]
        if len(entry.shape) != 2:
            raise ValueError(f"{path}: tensor {tensor!r} is not 2-D (shape {list(entry.shape)})")
        fmt = BY_GGUF_TYPE.get(entry.dtype)
        if fmt is None:
            supported = ", ".join(BY_GGUF_TYPE)
            raise ValueError(f"{path}: tensor {tensor!r} is {entry.dtype}, which ple does not "
                             f"decode (it decodes {supported})")
        cols = entry.shape[1]
        # Whole blocks and the data size were checked by the header walk, with
        # gguf's block sizes (which ple's formats repeat; a test keeps them equal).
        if cols == 0:
            raise ValueError(f"{path}: tensor {tensor!r}: a row of {cols} values is not a whole "
                             f"number of {entry.dtype} blocks of {fmt.block_size}")
        _check_row_bytes(f"{path}: tensor {tensor!r}", fmt.row_bytes(cols))  # only with no rows
        return cls(tensor, [entry], fmt, 1.0, config or GatherConfig())

    @property
    def handle(self) -> int:
        if self._handle is None:
            # Under torch.compile(fullgraph=True) dynamo reports this as an
            # "Observed exception" (Unsupported) that quotes this message.
            raise ValueError(f"ple table {self.name!r} is closed: {COMPILED_HINT}")
        return self._handle

    @property
    def dtype(self) -> torch.dtype:
        """The dtype disk_gather returns when none is asked for."""
        return self.row_format.default_dtype

    @property
    def config(self) -> GatherConfig:
        return self._config

    @config.setter
    def config(self, config: GatherConfig) -> None:
        if not isinstance(config, GatherConfig):
            raise TypeError(f"config must be a ple.GatherConfig, not {type(config).__name__}")
        self._push_config(config)
        self._config = config  # only once the native side took it

    def _push_config(self, c: GatherConfig) -> None:
        native.configure(self.handle, c.policy, c.prefetch_window_kib * 1024, c.threads,
                         c.row_cache_mib << 20)

    @property
    def resident_range(self) -> tuple[int, int]:
        """``(begin, end)``: rows ``[begin, end)`` are in the device and host
        tiers (``(0, 0)`` without tiers)."""
        return self.placement.resident_range if self.placement is not None else (0, 0)

    def place(self, device_rows: int = 0, host_rows: int = 0, device=None,
              progress: Callable[[int, int], None] | None = None, *, first_row: int = 0) -> None:
        """Keeps rows ``[first_row, first_row + device_rows)`` in the memory of
        ``device`` (a GPU) and the next ``host_rows`` rows in host memory
        (page-locked when CUDA is there); the rest stay on disk.  Gathers then
        read each id from its tier, with the same bytes.  The rows are read
        now; ``progress(done, total)`` is called as they are.  ``place()``
        with no rows drops the tiers.  A CUDA graph captured before a
        ``place`` keeps the tiers it was captured with (they stay in memory
        until the table closes).  ``first_row``: where the tiers start, for
        example a tensor-parallel rank's own rows, or one layer's rows of a
        table that several layers share."""
        for name, value in (("device_rows", device_rows), ("host_rows", host_rows),
                            ("first_row", first_row)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"ple: {name} must be a non-negative int, got {value!r}")
        if first_row + device_rows + host_rows > self.num_rows:
            raise ValueError(f"ple: first_row + device_rows + host_rows = "
                             f"{first_row + device_rows + host_rows} is more than the "
                             f"{self.num_rows} rows of table {self.name!r}")
        if device_rows:
            device = torch.device(device if device is not None else "cuda")
            if device.type != "cuda":
                raise ValueError(f"ple: the device tier lives on a CUDA device, not {device}")
            if not torch.cuda.is_available():
                raise RuntimeError("ple: device_rows needs a CUDA device, and none is available")
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
        self._retire_placement()
        if device_rows or host_rows:
            # Read past the row cache: these rows are about to be resident, and
            # would only push rows the cache should serve out of it.
            self.placement = Placement(lambda ids, out: native.read_for_tiers(self.handle, ids, out),
                                       self.row_bytes, device_rows, host_rows,
                                       device if device_rows else None, first_row, progress)

    def _retire_placement(self) -> None:
        old, self.placement = self.placement, None
        if old is None:
            return
        if old.captured:
            self._retired_placements.append(old)
            return
        for staging in self._staging.values():
            staging.stream.synchronize()
        old.free()

    def gather_bytes(self, ids, out: torch.Tensor | None = None) -> torch.Tensor:
        """The raw rows ``ids`` as uint8 ``[*ids.shape, row_bytes]``, written
        into ``out`` when given.  Every id is checked before anything is written."""
        ids = torch.as_tensor(ids)
        if ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"ple: ids must be an int32 or int64 tensor, not {ids.dtype}")
        if ids.device.type != "cpu":
            raise ValueError(f"ple: gather_bytes reads ids on the CPU, not {ids.device}")
        shape = (*ids.shape, self.row_bytes)
        if self.num_rows == 0 and ids.numel():
            # Before the output is allocated: a table of no rows may claim rows
            # too wide to allocate, and every id is out of its range anyway.
            raise IndexError(f"row id {int(ids.reshape(-1)[0])} at position 0 is out of range [0, 0)")
        if out is None:
            out = torch.empty(shape, dtype=torch.uint8)
        elif (out.dtype != torch.uint8 or tuple(out.shape) != shape or out.device.type != "cpu"
              or not out.is_contiguous()):
            raise ValueError(f"ple: out must be a contiguous CPU uint8 tensor of shape "
                             f"{list(shape)}, not {out.dtype} {list(out.shape)} on {out.device}")
        flat = ids.reshape(-1).contiguous()
        native.gather(self.handle, flat, out, *self.resident_range)
        if self.placement is not None:
            self.placement.fill_cpu(flat, out.view(-1, self.row_bytes))
        return out

    def prefetch(self, ids) -> None:
        """Starts gathering ``ids`` (on the host) on a background thread.  The
        next gather of exactly these ids (int64) on this table, by an operator
        on any device, waits for it instead of reading the rows itself; other
        ids are gathered as usual.  Counted in ``prefetch_hits`` and
        ``prefetch_misses``."""
        ids = torch.as_tensor(ids)
        if ids.dtype not in (torch.int32, torch.int64) or ids.device.type != "cpu":
            raise TypeError(f"ple: prefetch takes int32 or int64 ids on the CPU, not {ids.dtype} "
                            f"on {ids.device}")
        native.prefetch(self.handle, ids.reshape(-1).to(torch.int64).contiguous(),
                        *self.resident_range)

    def staging_for(self, stream: torch.cuda.Stream) -> StreamStaging:
        """The pinned buffers of this table on a CUDA stream."""
        key = (stream.device.index, stream.cuda_stream)
        staging = self._staging.get(key)
        if staging is None:
            staging = self._staging[key] = StreamStaging(stream, self.row_bytes)
        return staging

    def pinned_bytes(self) -> int:
        """Page-locked host memory held for the CUDA operator (all streams) and
        the host tier."""
        placements = [p for p in (self.placement, *self._retired_placements) if p is not None]
        return (sum(staging.nbytes() for staging in self._staging.values())
                + sum(p.nbytes_pinned() for p in placements))

    def stats(self) -> dict[str, int]:
        """Cumulative counters of every gather on this table (README "Counters");
        reading them waits for the CUDA gathers already enqueued."""
        stats = dict(native.stats(self.handle))
        hits = (0, 0) if self.placement is None else self.placement.hits()
        stats["device_tier_hits"], stats["host_tier_hits"] = hits
        return stats

    def reset_stats(self) -> None:
        native.reset_stats(self.handle)
        if self.placement is not None:
            self.placement.reset_hits()

    def drop_page_cache(self) -> None:
        """Evicts this table's pages from the page cache (for cold benchmarks);
        pages that another process or table maps stay."""
        native.drop_page_cache(self.handle)

    def close(self) -> None:
        """Unmaps the files; a gather in progress on another thread finishes
        first, a prefetch in progress is stopped.  Waits for the CUDA streams
        this table staged rows on, then frees its pinned buffers: a CUDA
        graph that gathers from this table must not be replayed after it is
        closed.  Closing again does nothing; a close while another thread's
        runs waits for it.  In a child forked from a process that used CUDA,
        the parent's CUDA buffers and tiers are left as they are (the child
        cannot free them)."""
        # One lock per table, however many threads come here first.
        with self.__dict__.setdefault("_close_lock", threading.Lock()):
            handle = self._handle
            if handle is None:
                return
            if native.forked_after_cuda() or getattr(torch.cuda, "_is_in_bad_fork", bool)():
                _left_to_the_parent.append((dict(self._staging), self.placement,
                                            list(self._retired_placements)))
            else:
                for staging in self._staging.values():
                    staging.stream.synchronize()
                    staging.free()
                for placement in (self.placement, *self._retired_placements):
                    if placement is not None:
                        placement.free()
            self._staging.clear()
            self.placement = None
            self._retired_placements = []
            _open_tables.pop(handle, None)
            native.close_table(handle)  # without the GIL: it waits for the prefetch thread
            self._handle = None

    def __enter__(self) -> "Table":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        # At interpreter exit the native module may already be gone.
        if getattr(self, "_handle", None) is not None and native is not None and threading is not None:
            self.close()

    def __repr__(self) -> str:
        state = "closed" if self._handle is None else f"handle={self._handle}"
        return (f"ple.Table({self.name!r}, {self.num_rows} rows x {self.cols} {self.format}, "
                f"{len(self.shard_rows)} shard(s), scale={self.scale}, {state})")
