"""``ple.Table``: a row-major embedding table that stays in its checkpoint
files, from opening (safetensors or GGUF) to close: its native handle, its
gather settings, its tiers, its CUDA staging buffers and its counters.
Which table of a set of safetensors files is opened: safetensors_tables.py."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import mmap
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path

import torch

from .kernels.native import native
from .mapped_files import guard_writers

from .config import GatherConfig
from .files import resolved_regular_file
from .counters import COUNTERS
from .formats import BY_GGUF_TYPE, RowFormat, check_row_bytes
from .gguf_header import GGUFHeader, read_gguf_header
from .safetensors_header import TensorEntry
from .safetensors_tables import PathsLike, read_scale_tensor, select_table
from .progress import rows_progress
from .staging import StreamStaging
from .tiers import Tiers

# Open tables by handle, for the operators; a table that is dropped closes.
_open_tables: "weakref.WeakValueDictionary[str, Table]" = weakref.WeakValueDictionary()
_registry_lock = threading.Lock()
# What tables closed in a forked child held of their parent's CUDA state (pinned
# buffers, streams, tiers): the child can neither use nor free it, so it stays.
_left_to_the_parent: list = []
# The handles of the last tables closed, so that a call with the handle of a
# closed table says it is closed rather than unknown.
_closed_handles: dict[str, str] = {}
MAX_NAMES_KEPT = 4096
COMPILED_HINT = ("a table must stay open while code that gathers from it runs, compiled code "
                 "and captured CUDA graphs included")
ELSEWHERE_HINT = ("a handle names a table by its tensor and its files' identity (device, inode, "
                  "size, modification time), so that a program saved, exported, traced, cached "
                  "or sent to another process reaches the same table or none: open that table in "
                  "this process before running the program, or make the program again where the "
                  "files have changed")
# Hex digits of a handle's digest of the table's files and layout.
DIGEST_CHARS = 16


def table_for_handle(handle: str) -> "Table":
    """The open table of ``handle`` (the operators' way to it): the table it
    was taken from or, where that one was closed or lives in another process,
    a table open here on the same files with the same layout (the same bytes).
    A ValueError naming the table and the cause otherwise."""
    table = _open_tables.get(handle)
    if table is not None:
        return table
    if not isinstance(handle, str):
        raise TypeError(f"ple: a table handle is a str (ple.Table.handle), not "
                        f"{type(handle).__name__} {handle!r}")
    if "@" not in handle:  # every handle holds "@": a name, most likely the tensor's
        with _registry_lock:
            named = [h for h, t in _open_tables.items() if t.name == handle]
        if named:
            raise ValueError(f"ple: {handle!r} is a tensor name, not a table handle: pass the "
                             f"table's handle, table.handle ({named[0]!r}), or call "
                             f"ple.gather(table, ids)")
        raise ValueError(f"ple: {handle!r} is not a table handle (\"<name>@<digest>\"): pass an "
                         f"open table's table.handle, or call ple.gather(table, ids)")
    name, same_files = _split_handle(handle)
    with _registry_lock:
        open_now = list(_open_tables.values())
    for table in open_now:
        if table._same_files == same_files:
            return table
    if handle in _closed_handles:
        raise ValueError(f"ple table {name!r} (handle {handle}) is closed: {COMPILED_HINT}")
    others = [t.handle for t in open_now if t.name == name]
    if others:
        raise ValueError(f"ple table {name!r} (handle {handle}) is not open in this process; "
                         f"the table of that name open here, {others[0]}, is another one (other "
                         f"files, or files that changed): {ELSEWHERE_HINT}")
    raise ValueError(f"ple table {name!r} (handle {handle}) is not open in this process: "
                     f"{ELSEWHERE_HINT}")


def check_dense_ids(ids: torch.Tensor, caller: str) -> None:
    """A TypeError saying what ``caller`` takes when ``ids`` is sparse or
    nested: torch's own messages for those ("NestedTensorImpl doesn't
    support sizes", "Could not run 'ple::disk_gather' with arguments from
    the 'SparseCPU' backend") say nothing of it."""
    takes = f"{caller} takes ids as a dense (strided) int32 or int64 tensor of any shape"
    if ids.is_nested:
        raise TypeError(f"{takes}, not a nested tensor: gather ids.values() (layout=torch.jagged) "
                        f"or each of ids.unbind()")
    if ids.layout != torch.strided:
        raise TypeError(f"{takes}, not a {ids.layout} tensor: pass ids.to_dense()")


def _split_handle(handle: str) -> tuple[str, str]:
    """A handle's table name, and the part that every table opened on the same
    files with the same layout shares (the handle without its "#n")."""
    name, _, digest = handle.rpartition("@")
    return name, f"{name}@{digest[:DIGEST_CHARS]}"


def _files_digest(files: list[os.stat_result], layout: tuple) -> str:
    """What the handles of tables on these files with this layout share: a
    digest of the files' identities and of the layout."""
    identities = [(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) for st in files]
    digest = hashlib.blake2b(repr((identities, layout)).encode(), digest_size=DIGEST_CHARS // 2)
    return digest.hexdigest()


def _register(table: "Table", same_files: str) -> str:
    """Registers an open table; its handle is ``same_files``, with "#n" for
    the n-th table open on them (a copy, say) so that each has its own."""
    with _registry_lock:
        handle, n = same_files, 1
        while handle in _open_tables:
            n += 1
            handle = f"{same_files}#{n}"
        _open_tables[handle] = table
        _closed_handles.pop(handle, None)
    return handle


def _mapped_tensor(fd: int, entry: TensorEntry, dtype: torch.dtype) -> torch.Tensor:
    """The tensor ``entry`` of the file open as ``fd``, over a private mapping
    of its bytes."""
    if entry.nbytes == 0:
        return torch.empty(entry.shape, dtype=dtype)
    start = entry.offset - entry.offset % mmap.ALLOCATIONGRANULARITY
    mapping = mmap.mmap(fd, entry.offset + entry.nbytes - start, access=mmap.ACCESS_COPY,
                        offset=start)
    mapping.madvise(mmap.MADV_SEQUENTIAL)
    data = torch.frombuffer(mapping, dtype=torch.uint8, count=entry.nbytes,
                            offset=entry.offset - start)
    return data.view(dtype).reshape(entry.shape)


def _forget(handle: str, name: str) -> None:
    with _registry_lock:
        _open_tables.pop(handle, None)
        _closed_handles[handle] = name
        while len(_closed_handles) > MAX_NAMES_KEPT:
            del _closed_handles[next(iter(_closed_handles))]  # the oldest


def _reopen(opened_from: tuple, layout: tuple, config: "GatherConfig", placement) -> "Table":
    """A pickled table, opened again on the files it was opened from, with
    its config and, where this process can hold them, its tiers."""
    kind, paths, name, scale = opened_from
    if kind == "gguf":
        table = Table.from_gguf(paths[0], name, config)
    else:
        table = Table.from_safetensors(paths, name, config, scale=scale)
    if table._layout != layout:
        table.close()
        raise ValueError(f"ple table {name!r} cannot be opened again as it was pickled: "
                         f"{', '.join(map(str, paths))} now hold it with another layout (shards, "
                         f"offsets, format, scale); the files changed since")
    if placement is not None:
        device_rows, host_rows, device, first_row = placement
        if device_rows and not torch.cuda.is_available():
            warnings.warn(f"ple table {name!r} was pickled with {device_rows} rows in a device "
                          f"tier on {device}, and this process has no CUDA device: they are read "
                          f"from the files", stacklevel=2)
            device_rows, device = 0, None
        table.place(device_rows, host_rows, device, first_row=first_row)
    return table


class Table:
    """A table whose rows stay in their files, read by ``torch.ops.ple`` operators.

    Open one with :meth:`from_safetensors` or :meth:`from_gguf`; nothing of
    its rows is read until they are gathered.  Close it (or use it as a
    context manager) to unmap its files; a table that is dropped closes too.

    Attributes:
        name: the tensor's name, or a shard family's prefix.
        num_rows: rows of the table, every shard together.
        cols: values in a row.
        format: the row format's name (a key of ``ple.FORMATS``: ``"f32"``,
            ``"fp8_e4m3fn"``, ``"q4_k"``, ...).
        row_format: that format (``ple.formats.RowFormat``): how the bytes of
            a row become values.
        row_bytes: bytes of one row in the files, and in the tiers.
        scale: what the values of fp8/u8/i8 rows are multiplied by (1.0 for
            the other formats).
        shard_rows: the rows of each shard, in row order (one entry for a
            single tensor).
        paths: the files the shards are in, each once, in shard order, as
            absolute real paths (symlinks resolved) made once, at open: a
            copy, a pickle or a spawned worker opens these same files
            whatever the working directory is by then.
        file_ids: ``(device, inode)`` of each of ``paths`` when opened: the
            files it is served from, whatever names they have.
        tensor_names: the table's tensors as messages name them: the
            tensor's name, or ``<prefix>.shard_{0..n-1}.weight``.
        handle: the str the operators take (``torch.ops.ple.disk_gather(ids,
            table.handle)``): the table's name and a digest of its files'
            identity and its layout, so that compiled code, captured CUDA
            graphs and programs saved or sent elsewhere hold the table itself,
            not a slot of this process (``"<name>@<digest>"``, with ``"#n"``
            for the n-th table open here on the same files); a ValueError once
            the table is closed.
        dtype: what ``disk_gather`` returns when no dtype is asked for.
        config: the ``ple.GatherConfig`` of its gathers; assign a new one to
            change them from the next call.
        io_backend: what reads its rows from the files: "mmap" (with
            ``config.io == "mmap"``), or the direct-I/O backend chosen when
            the config was assigned: "io_uring", "aio" or "pread".
        io_block_bytes: with ``io="direct"``, the block its reads are made
            of (512 or 4096 by default: the files' direct-I/O alignment).
        tiers: the rows kept in device and host memory (``ple.tiers.Tiers``,
            made by :meth:`place`), or None.
        resident_range: ``(begin, end)``: rows ``[begin, end)`` are in the
            tiers, the others are read from the files; ``(0, 0)`` without
            tiers.
        COUNTERS: what :meth:`stats` returns, name to meaning (``ple.COUNTERS``).
    """

    COUNTERS = COUNTERS

    def __init__(self, name: str, shards: list[TensorEntry], fmt: RowFormat, scale: float,
                 config: GatherConfig, opened_from: tuple, scale_tensor: TensorEntry | None = None):
        """Maps ``shards`` (checked by the caller) as one table; use
        :meth:`from_safetensors` or :meth:`from_gguf`, which choose them.
        ``opened_from``: how to open it again (``_reopen``); ``scale_tensor``:
        the checkpoint tensor of the scale, where one holds it."""
        self.name = name
        self._shards = list(shards)
        self._scale_tensor = (None if scale_tensor is None
                              else (scale_tensor.name, read_scale_tensor(scale_tensor)))
        self.format = fmt.name
        self.row_format = fmt
        self.scale = scale
        self.cols = shards[0].shape[1]
        self.row_bytes = fmt.row_bytes(self.cols)
        self.num_rows = sum(s.shape[0] for s in shards)
        self.shard_rows = [s.shape[0] for s in shards]
        self.paths = list(dict.fromkeys(s.path for s in shards))
        file_index = {path: i for i, path in enumerate(self.paths)}
        self._opened_from = opened_from
        files = [os.stat(p) for p in self.paths]
        self.file_ids = [(st.st_dev, st.st_ino) for st in files]
        self._layout = (name, fmt.name, scale, self.cols,
                        [(file_index[s.path], s.offset, s.shape[0]) for s in shards],
                        [st.st_size for st in files])
        self._staging: dict[tuple[int, ...], StreamStaging] = {}
        self._captures = itertools.count()  # keys the buffers of each captured graph
        self.tiers: Tiers | None = None
        # Tiers replaced while a CUDA graph still reads them: freed at close.
        self._retired_tiers: list[Tiers] = []
        # Guards the open state, the tiers and the count of calls using them.
        self._state_lock = threading.Lock()
        # One config assignment at a time, from the native side's taking it to
        # the record that `config` reads: the config read is the one in force.
        # Reentrant: a signal handler that reads the config may run inside an
        # assignment.
        self._config_lock = threading.RLock()
        self._calls = 0
        self._closing = False
        self._same_files = f"{name}@{_files_digest(files, self._layout)}"
        self._native = native.open_table(
            [os.fsencode(p) for p in self.paths], [file_index[s.path] for s in shards],
            [s.offset for s in shards], self.shard_rows, self.row_bytes)
        try:
            self._push_config(config)
        except BaseException:
            native.close_table(self._native)
            raise
        self._config = config
        self._handle = _register(self, self._same_files)
        guard_writers()

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
        chosen = select_table(paths, tensor, scale)
        files = [str(p) for p in dict.fromkeys(s.path for s in chosen.shards)]
        return cls(chosen.name, chosen.shards, chosen.row_format, chosen.scale,
                   config or GatherConfig(),
                   ("safetensors", files, chosen.name,
                    chosen.scale if chosen.row_format.scaled else None), chosen.scale_tensor)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike, tensor: str,
                  config: GatherConfig | None = None) -> "Table":
        """Opens one 2-D tensor of a GGUF file as a table without reading its
        rows: F32, F16, BF16, or a block format (every type
        ``gguf.quants.dequantize`` decodes: ``ple.formats.BLOCK_FORMATS``),
        kept packed and decoded only for the rows gathered."""
        path = Path(path)
        return cls._from_gguf_header(path, read_gguf_header(path), tensor, config)

    @classmethod
    def _from_gguf_header(cls, path: Path, header: GGUFHeader, tensor: str,
                          config: GatherConfig | None) -> "Table":
        """from_gguf with the file's header read already (a layer that needs
        its key-values too reads it once)."""
        path = resolved_regular_file(path)
        entries = header.tensors
        if tensor not in entries:
            candidates = sorted(n for n, e in entries.items() if len(e.shape) == 2)
            raise ValueError(f"{path}: no tensor named {tensor!r}; 2-D tensors: {candidates}")
        entry = dataclasses.replace(entries[tensor], path=path)
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
        check_row_bytes(f"{path}: tensor {tensor!r}", fmt.row_bytes(cols))  # only with no rows
        return cls(tensor, [entry], fmt, 1.0, config or GatherConfig(),
                   ("gguf", [str(path)], tensor, None))

    def checkpoint_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The checkpoint tensors the table is served from, by their names in
        the files: ``(shards, scale)``, the shards in row order (one tensor, or
        a shard family's), and the scale tensor where one holds the scale.

        Each shard is a CPU tensor over the bytes of the very file the table
        maps (a private mapping of it, whatever names the file has by now):
        nothing is read until the tensor is, saving it streams the rows from
        the file through the page cache, and writing to it changes nothing on
        disk.  A ValueError for a GGUF table (its blocks are no torch dtype)
        and for a closed one."""
        if self.row_format.safetensors_dtype is None or self._opened_from[0] != "safetensors":
            raise ValueError(f"ple table {self.name!r} is a GGUF tensor of {self.format} blocks, "
                             "which no torch tensor holds: only a safetensors table gives its "
                             "checkpoint tensors")
        fds = native.file_descriptors(self._native_handle())
        try:
            shards = {entry.name: _mapped_tensor(fds[self.paths.index(entry.path)], entry,
                                                 self.row_format.storage)
                      for entry in self._shards}
        finally:
            for fd in fds:
                os.close(fd)
        scale = {} if self._scale_tensor is None else {
            self._scale_tensor[0]: self._scale_tensor[1].clone()}
        return shards, scale

    @property
    def tensor_names(self) -> str:
        """The table's tensors as messages name them: the tensor's name, or its
        shard family's ``<prefix>.shard_{0..n-1}.weight``."""
        if len(self.shard_rows) == 1:
            return self.name
        return f"{self.name}.shard_{{0..{len(self.shard_rows) - 1}}}.weight"

    @property
    def handle(self) -> str:
        """The str the operators take; a ValueError once the table is closed."""
        if self._closing:
            # Under torch.compile(fullgraph=True) dynamo reports this as an
            # "Observed exception" (Unsupported) that quotes this message.
            raise ValueError(f"ple table {self.name!r} is closed: {COMPILED_HINT}")
        return self._handle

    def acquire(self) -> tuple[int, Tiers | None]:
        """Starts a call that reads the table: its native handle and one
        snapshot of its tiers, which stay in memory (a ``place`` or ``close``
        meanwhile included) until :meth:`release` of the same tiers.  The
        operators bracket every gather with the two."""
        with self._state_lock:
            if self._closing:
                raise ValueError(f"ple table {self.name!r} (handle {self._handle}) is closed: "
                                 f"{COMPILED_HINT}")
            self._calls += 1
            tiers = self.tiers
            if tiers is not None:
                tiers.calls += 1
            return self._native, tiers

    def release(self, tiers: Tiers | None) -> None:
        """Ends a call that :meth:`acquire` started; the last call out frees
        what a ``place`` or ``close`` left to it."""
        free = False
        with self._state_lock:
            self._calls -= 1
            if tiers is not None:
                tiers.calls -= 1
                if tiers.retired and tiers.calls == 0:
                    if tiers.captured:  # kept until close, once
                        if tiers not in self._retired_tiers:
                            self._retired_tiers.append(tiers)
                    else:
                        free = True
            finish_close = self._closing and self._calls == 0 and self._native is not None
        if free:
            self._free_tiers(tiers)
        if finish_close:
            self._finish_close()

    @property
    def dtype(self) -> torch.dtype:
        """The dtype disk_gather returns when none is asked for."""
        return self.row_format.default_dtype

    @property
    def config(self) -> GatherConfig:
        """The settings of this table's gathers; assigning a ``GatherConfig``
        applies it from the next call (a TypeError for anything else; a
        row cache budget that cannot be had is a MemoryError, and the old
        config stays).  Assignments from several threads take effect one
        at a time, and a read returns the config in force."""
        with self._config_lock:
            return self._config

    @config.setter
    def config(self, config: GatherConfig) -> None:
        if not isinstance(config, GatherConfig):
            raise TypeError(f"config must be a ple.GatherConfig, not {type(config).__name__}")
        with self._config_lock:
            self._push_config(config)
            self._config = config  # only once the native side took it

    def _push_config(self, c: GatherConfig) -> None:
        native.configure(self._native_handle(), *c._native_args())

    def _native_handle(self) -> int:
        """The native table's handle, for calls that neither read rows nor tiers."""
        if self._closing:
            raise ValueError(f"ple table {self.name!r} is closed: {COMPILED_HINT}")
        return self._native

    @property
    def io_backend(self) -> str:
        """What reads rows from the files: "mmap", or with ``io="direct"``
        "io_uring", "aio" or "pread" (the first that this process may use,
        from the one the environment variable ``PLE_IO_BACKEND`` names)."""
        return native.io_backend(self._native_handle())

    @property
    def io_block_bytes(self) -> int | None:
        """With ``io="direct"``, the bytes of the blocks its reads are made of
        (``config.io_block_bytes``, or the files' direct-I/O alignment where
        that is 0 or smaller); None with ``io="mmap"``."""
        return native.io_block_bytes(self._native_handle()) or None

    @property
    def resident_range(self) -> tuple[int, int]:
        """``(begin, end)``: rows ``[begin, end)`` are in the device and host
        tiers (``(0, 0)`` without tiers)."""
        tiers = self.tiers
        return tiers.resident_range if tiers is not None else (0, 0)

    def place(self, device_rows: int = 0, host_rows: int = 0, device=None,
              progress: Callable[[int, int], None] | bool | None = None, *,
              first_row: int = 0) -> None:
        """Keeps rows ``[first_row, first_row + device_rows)`` in the memory of
        ``device`` (a GPU) and the next ``host_rows`` rows in host memory
        (page-locked when CUDA is there); the rest stay on disk.  Gathers then
        read each id from its tier, with the same bytes.  The rows are read
        now; ``progress(done, total)`` is called as they are
        (``progress=True``: a progress bar on stderr).  ``place()``
        with no rows drops the tiers.  The new tiers are read before the old
        ones are dropped (a ``place`` that fails keeps them; one that
        replaces tiers needs room for both meanwhile), and gathers already
        running finish on the old ones.  A CUDA graph captured before a
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
        new = None
        if device_rows or host_rows:
            handle, held = self.acquire()
            try:
                # Read past the row cache: these rows are about to be resident, and
                # would only push rows the cache should serve out of it.
                with rows_progress(progress, self.row_bytes, f"placing {self.name}") as report:
                    new = Tiers(lambda ids, out: native.read_for_tiers(handle, ids, out),
                                self.row_bytes, device_rows, host_rows,
                                device if device_rows else None, first_row, report)
            finally:
                self.release(held)
        # Only once the new tiers are whole: a place that fails keeps the old ones.
        with self._state_lock:
            if self._closing:
                closed = True
            else:
                closed, old, self.tiers = False, self.tiers, new
        if closed:
            if new is not None:
                new.free()
            raise ValueError(f"ple table {self.name!r} was closed while place() read its tiers")
        self._retire(old)

    def _retire(self, old: Tiers | None) -> None:
        """Drops tiers that ``self.tiers`` no longer holds: frees them now, or
        leaves them to the last call that reads them, or keeps them until
        close when a CUDA graph captured them."""
        if old is None:
            return
        with self._state_lock:
            old.retired = True
            if old.captured:
                self._retired_tiers.append(old)
                return
            free = old.calls == 0
        if free:
            self._free_tiers(old)

    def _free_tiers(self, tiers: Tiers) -> None:
        for staging in list(self._staging.values()):
            staging.stream.synchronize()
        tiers.free()

    def gather_bytes(self, ids, out: torch.Tensor | None = None, owner: int = 0) -> torch.Tensor:
        """The raw rows ``ids`` as uint8 ``[*ids.shape, row_bytes]``, written
        into ``out`` when given.  Every id is checked before anything is
        written.  ``owner``: the prefetch owner it gathers for (0: none), whose
        plan it advances or ends (:meth:`plan_prefetches`)."""
        ids = torch.as_tensor(ids)
        check_dense_ids(ids, "ple: gather_bytes")
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
        handle, tiers = self.acquire()
        try:
            if tiers is None:
                native.gather(handle, flat, out, 0, 0, owner)
            else:
                native.gather(handle, flat, out, *tiers.resident_range, owner)
                tiers.fill_cpu(flat, out.view(-1, self.row_bytes))
        finally:
            self.release(tiers)
        return out

    def prefetch(self, ids, owner: int = 0) -> int:
        """Starts gathering ``ids`` (on the host) on a background thread.  The
        next gather of exactly these ids on this table, or of ids that begin
        with them (a batch padded after them, as a CUDA graph pads it), by an
        operator on any device, takes their rows instead of reading them;
        other ids are gathered as usual.  Counted in ``prefetch_hits`` and
        ``prefetch_misses``.  ``owner`` (an int >= 0; 0: nobody's) names the
        set the prefetch belongs to (a lookahead plan's), for
        :meth:`drop_prefetches` and :meth:`prefetched_bytes`.  Returns the
        prefetch's ticket, larger than those of the table's earlier
        prefetches (0: the table is closing and nothing was started)."""
        ids = torch.as_tensor(ids)
        check_dense_ids(ids, "ple: prefetch")
        if ids.dtype not in (torch.int32, torch.int64) or ids.device.type != "cpu":
            raise TypeError(f"ple: prefetch takes int32 or int64 ids on the CPU, not {ids.dtype} "
                            f"on {ids.device}")
        handle, tiers = self.acquire()
        try:
            return native.prefetch(handle, ids.reshape(-1).to(torch.int64).contiguous(),
                                   *(tiers.resident_range if tiers is not None else (0, 0)), owner)
        finally:
            self.release(tiers)

    def plan_prefetches(self, owner: int, chunks: list[torch.Tensor], max_bytes: int) -> int:
        """Starts the plan of ``owner`` (an int > 0): ``chunks`` (CPU int64
        tensors, each flattened) are the ids of its next gathers, in order,
        each of them as the gather will ask for it.  They are prefetched in
        order while the owner's prefetches hold at most ``max_bytes`` of rows
        (at least the next chunk), the first ones now.  The plan advances as
        the owner's gathers run (on the host, in a CUDA stream, on a captured
        graph's replays: every gather of ``disk_gather``'s ``owner``): one
        that takes the next chunk's prefetch, of that chunk's size, lets the
        next chunks be read; any other gather of the owner, and one that
        raises, ends it, dropping what it read ahead.  Replaces the owner's
        plan (:meth:`end_plan`).  Returns the plan's number, for
        :meth:`end_plan` and :meth:`planning` (0: no chunks, or the table is
        closing)."""
        if not isinstance(owner, int) or isinstance(owner, bool) or owner < 1:
            raise ValueError(f"ple: a plan's owner is an int > 0, not {owner!r}")
        most = native.MAX_PENDING_BYTES
        if (not isinstance(max_bytes, int) or isinstance(max_bytes, bool)
                or not 0 < max_bytes <= most):
            raise ValueError(f"ple: a plan's bound is more than 0 and at most {most} bytes (what "
                             f"a table's prefetches hold), not {max_bytes!r}")
        chunks = [chunk.reshape(-1) for chunk in chunks]
        sizes = [chunk.numel() for chunk in chunks]
        ids = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.int64)
        if ids.dtype != torch.int64 or ids.device.type != "cpu":
            raise TypeError(f"ple: a plan's chunks are int64 ids on the CPU, not {ids.dtype} on "
                            f"{ids.device}")
        handle, tiers = self.acquire()
        try:
            return native.plan_prefetches(
                handle, owner, ids.contiguous(), sizes, max_bytes,
                *(tiers.resident_range if tiers is not None else (0, 0)))
        finally:
            self.release(tiers)

    def end_plan(self, owner: int, plan: int | None = None) -> None:
        """Ends the plan of ``owner`` when it is ``plan`` (whichever it has:
        None), and then drops the owner's prefetches that no gather has taken
        (with None, even where it has no plan): when it returns, no read of
        theirs runs.  On a closed table it does nothing."""
        try:
            handle, tiers = self.acquire()
        except ValueError:  # closed
            return
        try:
            native.end_plan(handle, owner, plan)
        finally:
            self.release(tiers)

    def planning(self, owner: int, plan: int | None = None) -> bool:
        """Whether ``owner``'s plan ``plan`` (whichever it has: None) has
        chunks to come, read ahead or not; False on a closed table."""
        try:
            handle, tiers = self.acquire()
        except ValueError:  # closed
            return False
        try:
            return native.planning(handle, owner, plan)
        finally:
            self.release(tiers)

    def drop_prefetches(self, owner: int | None = None, through: int | None = None) -> int:
        """Drops the prefetches of ``owner`` (every owner's: None) that no
        gather has taken yet, those of tickets up to ``through`` (all: None),
        cancelling the one being read: when it returns, no read of theirs
        runs, and their rows are freed.  A gather already waiting for its
        prefetch keeps it.  Returns the bytes of rows the dropped ones were to
        hold.  On a closed table it does nothing (closing dropped them all)."""
        try:
            handle, tiers = self.acquire()
        except ValueError:  # closed
            return 0
        try:
            return native.drop_prefetches(handle, owner, 2**64 - 1 if through is None else through)
        finally:
            self.release(tiers)

    def prefetched_bytes(self, owner: int | None = None) -> int:
        """The bytes of rows that the prefetches of ``owner`` (every owner's:
        None) hold, or will hold once read, until a gather takes them or they
        are dropped: what is read ahead and not yet taken.  0 on a closed
        table."""
        try:
            handle, tiers = self.acquire()
        except ValueError:  # closed
            return 0
        try:
            return native.prefetched_bytes(handle, owner)
        finally:
            self.release(tiers)

    def staging_for(self, stream: torch.cuda.Stream, capturing: bool = False) -> StreamStaging:
        """The pinned buffers of this table on a CUDA stream.  A graph being
        captured gets buffers of its own: it may be replayed on any stream,
        beside other graphs captured on the same stream (torch.cuda.graph
        captures every graph on one side stream unless told otherwise)."""
        key = (stream.device.index, stream.cuda_stream)
        if capturing:
            flag = self.staging_for(stream).bad_id_flag
            staging = StreamStaging(stream, self.row_bytes, bad_id_flag=flag)
            self._staging[(*key, next(self._captures))] = staging
            return staging
        staging = self._staging.get(key)
        if staging is None:
            staging = self._staging[key] = StreamStaging(stream, self.row_bytes)
        return staging

    def current_staging(self, device: int, capturing: bool = False) -> StreamStaging:
        """``staging_for`` the current stream of CUDA device ``device`` (an
        index), found by the stream's address: ``torch.cuda.current_stream``
        builds a Stream object, several microseconds of a small call."""
        if not capturing:
            staging = self._staging.get((device, torch._C._cuda_getCurrentRawStream(device)))
            if staging is not None:
                return staging
        return self.staging_for(torch.cuda.current_stream(device), capturing)

    def pinned_bytes(self) -> int:
        """Page-locked host memory held for the CUDA operator (all streams) and
        the host tier."""
        tiers = [t for t in (self.tiers, *self._retired_tiers) if t is not None]
        return (sum(staging.nbytes() for staging in self._staging.values())
                + sum(t.nbytes_pinned() for t in tiers))

    def stats(self) -> dict[str, int]:
        """Cumulative counters of every gather on this table since it was
        opened or ``reset_stats()``: the keys of ``ple.COUNTERS``, in its
        order (which says what each counts).  Reading them waits for the CUDA
        gathers already enqueued (their tier counters live on the GPU)."""
        values = dict(native.stats(self._native_handle()))
        tiers = self.tiers
        hits = (0, 0) if tiers is None else tiers.hits()
        values["device_tier_hits"], values["host_tier_hits"] = hits
        return {name: values[name] for name in COUNTERS}

    def reset_stats(self) -> None:
        """Sets every counter of :meth:`stats` to 0."""
        native.reset_stats(self._native_handle())
        tiers = self.tiers
        if tiers is not None:
            tiers.reset_hits()

    def drop_page_cache(self) -> None:
        """Evicts this table's pages from the page cache (for cold benchmarks);
        pages that another process or table maps stay."""
        native.drop_page_cache(self._native_handle())

    def close(self) -> None:
        """Unmaps the files once the calls reading the table are done (each
        gives its rows; a call that starts after this raises a ValueError), a
        prefetch in progress is stopped.  Waits for the CUDA streams this
        table staged rows on (every stream of their devices: a CUDA graph's
        replay that has begun is finished), then frees its pinned buffers and
        tiers: a CUDA graph that gathers from this table must not be replayed
        after it is closed.  Closing again does nothing.  In a child forked from a
        process that used CUDA, the parent's CUDA buffers and tiers are left
        as they are (the child cannot free them)."""
        with self._state_lock:
            if self._closing:
                return
            self._closing = True
            finish = self._calls == 0
        _forget(self._handle, self.name)
        if finish:
            self._finish_close()

    def _finish_close(self) -> None:
        """close's work, by close or by the last call that was reading the table."""
        with self._state_lock:
            handle, self._native = self._native, None
            tiers, self.tiers = self.tiers, None
            retired, self._retired_tiers = self._retired_tiers, []
        if handle is None:
            return
        if native.forked_after_cuda() or getattr(torch.cuda, "_is_in_bad_fork", bool)():
            _left_to_the_parent.append((dict(self._staging), tiers, retired))
        else:
            # Every stream of the devices, not only the staging streams: a CUDA
            # graph replays on whatever stream launches it, and a replay still
            # running uses the buffers and tiers freed here.
            for device in {staging.stream.device for staging in self._staging.values()}:
                torch.cuda.synchronize(device)
            for staging in self._staging.values():
                staging.free()
            for kept in (tiers, *retired):
                if kept is not None:
                    kept.free()
        self._staging.clear()
        native.close_table(handle)  # without the GIL: it waits for the prefetch thread

    def __reduce__(self):
        """Pickling (``torch.save``, ``copy.deepcopy``, a spawned worker) keeps
        how to open the table again on the same files, with its config and
        tiers; the copy is a table of its own (closing one leaves the other)."""
        if self._closing:
            raise ValueError(f"ple table {self.name!r} is closed: it cannot be pickled or copied")
        tiers = self.tiers
        placement = None if tiers is None else (
            tiers.device_rows, tiers.host_rows,
            None if tiers.device is None else str(tiers.device), tiers.first_row)
        return _reopen, (self._opened_from, self._layout, self._config, placement)

    def __enter__(self) -> "Table":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        # At interpreter exit the modules close uses may be gone already, and
        # the process's end unmaps the files anyway.
        try:
            if sys.is_finalizing() or not hasattr(self, "_handle"):
                return
        except (AttributeError, TypeError):
            return
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closing else f"handle={self._handle!r}"
        return (f"ple.Table({self.name!r}, {self.num_rows} rows x {self.cols} {self.format}, "
                f"{len(self.shard_rows)} shard(s), scale={self.scale}, {state})")
