"""GatherConfig(io="direct"): the rows no tier or row cache holds, read with
O_DIRECT by each backend (io_uring, Linux AIO, pread threads), against the
NumPy reference for the gather tests' geometries; the blocks it reads and the
counters; the row cache as its cache, and lookahead over it (its rows pinned there,
under pressure too); the backend's choice and fallback when
io_uring or AIO is refused; a truncated or replaced file; a filesystem that
refuses O_DIRECT; threads, close, fork and Ctrl-C.

The risky cases (forks, signals, seccomp) run in a subprocess with a timeout
(tests/test_process_safety.py's run_script)."""

from __future__ import annotations

import os
import subprocess
import threading
import time

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import ple
from helpers import (PAGE, ByteTable, close_while_threads_gather, resident_pages, run_threads,
                     write_byte_table, write_random_rows, write_sharded_table)
from ple import GatherConfig
from test_process_safety import expect_ok, run_script, skip_if_early, write_rows

BACKENDS = ("io_uring", "aio", "pread")
SHARD_ROWS = (97, 97, 77)
NUM_ROWS = sum(SHARD_ROWS)
BOUNDARY_ROWS = (0, NUM_ROWS - 1, 96, 97, 193, 194)
ROW_BYTES = (1, 17, 160, 4096, 8193)


def direct(threads: int = 1, row_cache_mib: int = 0, **fields) -> GatherConfig:
    return GatherConfig(io="direct", threads=threads, row_cache_mib=row_cache_mib, **fields)


@pytest.fixture(scope="module")
def usable_backends(tmp_path_factory) -> list[str]:
    """The backends this process may set up: where PLE_IO_BACKEND names one
    that is refused here (io_uring in many containers), the table takes the
    next (test_a_refused_io_uring_falls_back_with_the_same_bytes)."""
    path = tmp_path_factory.mktemp("probe") / "t.safetensors"
    save_file({"t": torch.zeros(4, 4)}, str(path))
    usable, before = [], os.environ.get("PLE_IO_BACKEND")
    try:
        with ple.Table.from_safetensors(path) as table:
            for name in BACKENDS:
                os.environ["PLE_IO_BACKEND"] = name
                table.config = direct()
                usable.append(table.io_backend)
    finally:
        if before is None:
            os.environ.pop("PLE_IO_BACKEND", None)
        else:
            os.environ["PLE_IO_BACKEND"] = before
    return [name for name in BACKENDS if name in usable]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch, usable_backends) -> str:
    """Each backend in turn: PLE_IO_BACKEND names the first one tried, and
    a table chooses when a config with io="direct" is assigned."""
    if request.param not in usable_backends:
        pytest.skip(f"{request.param} is refused here (usable: {usable_backends})")
    monkeypatch.setenv("PLE_IO_BACKEND", request.param)
    return request.param


@pytest.fixture(scope="module", params=ROW_BYTES, ids=lambda b: f"row_bytes={b}")
def sharded(request, tmp_path_factory) -> ByteTable:
    """test_gather's geometry: shards of 97, 97, 77 rows, 0 and 2 in a.safetensors,
    1 in b.safetensors, each file with a pad that moves the rows off alignment."""
    fx = write_sharded_table(tmp_path_factory.mktemp(f"direct{request.param}"), SHARD_ROWS, request.param)
    yield fx
    fx.table.close()


def request_ids(rng: np.random.Generator, num_rows: int = NUM_ROWS, n: int = 2000) -> np.ndarray:
    """n random ids with duplicates, the first, last and shard-boundary rows among them."""
    ids = rng.integers(0, num_rows, n, dtype=np.int64)
    specials = [r for r in BOUNDARY_ROWS if r < num_rows]
    ids[rng.choice(n, len(specials), replace=False)] = specials
    return ids


def block_bytes(fx: ByteTable, ids) -> int:
    """Bytes in the distinct blocks (of the table's io_block_bytes) under the
    rows ``ids``, each file's last block only as far as the file goes: what
    direct reads must read."""
    block = fx.table.io_block_bytes
    sizes = [os.path.getsize(p) for p in fx.table.paths]
    blocks = set()
    for i in np.unique(np.asarray(ids)).tolist():
        f, offset = int(fx.row_file[i]), int(fx.row_offset[i])
        blocks.update((f, b) for b in range(offset // block, (offset + fx.row_bytes - 1) // block + 1))
    return sum(min(block, sizes[f] - b * block) for f, b in blocks)


def gather(fx: ByteTable, ids) -> np.ndarray:
    return fx.table.gather_bytes(torch.as_tensor(ids)).numpy()


# Bytes ----------------------------------------------------------------------------

@pytest.mark.parametrize("block", [0, 4096], ids=lambda b: f"io_block_bytes={b}")
@pytest.mark.parametrize("row_cache_mib", [0, 4], ids=lambda m: f"row_cache_mib={m}")
@pytest.mark.parametrize("threads", [1, 3], ids=lambda t: f"threads={t}")
def test_direct_matches_the_reference_and_reads_each_block_once(sharded, backend, threads,
                                                                row_cache_mib, block):
    fx, table = sharded, sharded.table
    table.config = GatherConfig()  # no row cache: the one set next starts empty
    table.config = direct(threads, row_cache_mib, io_block_bytes=block)
    assert table.io_backend == backend
    ids = request_ids(np.random.default_rng([fx.row_bytes, threads, row_cache_mib]))
    table.reset_stats()
    assert np.array_equal(gather(fx, ids), fx.reference[ids])
    s = table.stats()
    assert s["calls"] == 1 and s["rows"] == len(ids)
    assert s["unique_pages"] == fx.expected_pages(ids)
    assert s["direct_read_bytes"] == block_bytes(fx, ids)
    assert 0 < s["direct_reads"] <= s["unique_pages"]
    assert s["advised_pages"] == s["major_faults"] == s["resident_pages"] == 0
    if row_cache_mib:
        assert s["row_cache_misses"] == len(ids) - s["row_cache_hits"]
        # Every row read is kept: the next gather reads nothing from the files.
        table.reset_stats()
        assert np.array_equal(gather(fx, ids), fx.reference[ids])
        s = table.stats()
        assert (s["row_cache_hits"], s["row_cache_misses"]) == (len(ids), 0)
        assert s["direct_reads"] == s["direct_read_bytes"] == s["unique_pages"] == 0


def test_the_last_row_of_a_file_that_ends_inside_a_block(sharded, backend):
    fx, table = sharded, sharded.table
    sizes = [os.path.getsize(p) for p in table.paths]
    last = [i for i in range(NUM_ROWS)
            if fx.row_offset[i] + fx.row_bytes == sizes[fx.row_file[i]]]
    assert last and all(sizes[fx.row_file[i]] % PAGE for i in last), "no row ends a file mid-block"
    table.config = direct()
    ids = np.array(last + last[::-1] + [0], dtype=np.int64)
    assert np.array_equal(gather(fx, ids), fx.reference[ids])


@pytest.fixture(scope="module")
def spread(tmp_path_factory) -> ByteTable:
    """6,000 rows of 8,193 B (48 MiB, off alignment by 1,001 B): the even rows
    lie three blocks each with a block between them, one read apiece, enough
    reads to spread over several threads."""
    fx = write_byte_table([tmp_path_factory.mktemp("spread") / "s.safetensors"], [6000], 8193,
                          seed=3, family=False, pads=(1001,))
    yield fx
    fx.table.close()


@pytest.mark.parametrize("threads, depth", [(1, 64), (3, 64), (3, 2), (16, 256), (2, 1)])
def test_reads_spread_over_threads_and_depths(spread, backend, threads, depth):
    table = spread.table
    table.config = direct(threads, io_queue_depth=depth)
    ids = np.arange(0, 6000, 2)[np.random.default_rng(depth).permutation(3000)]
    table.reset_stats()
    assert np.array_equal(gather(spread, ids), spread.reference[ids])
    s = table.stats()
    assert s["direct_reads"] == 3000
    assert s["direct_read_bytes"] == block_bytes(spread, ids)


def test_the_block_is_the_files_alignment_unless_asked_for_a_larger_one(spread):
    table = spread.table
    table.config = GatherConfig()
    assert table.io_block_bytes is None
    table.config = direct(io_block_bytes=0)
    alignment = table.io_block_bytes
    assert alignment in (512, 1024, 2048, 4096)
    table.config = direct(io_block_bytes=256)  # smaller than the files allow
    assert table.io_block_bytes == alignment
    table.config = direct(io_block_bytes=65536)
    assert table.io_block_bytes == 65536
    ids = np.arange(0, 6000, 7)
    table.reset_stats()
    assert np.array_equal(gather(spread, ids), spread.reference[ids])
    assert table.stats()["direct_read_bytes"] == block_bytes(spread, ids)


def test_int32_scalar_and_empty_ids(sharded):
    table = sharded.table
    table.config = direct()
    ids = request_ids(np.random.default_rng(9), n=300).astype(np.int32)
    assert np.array_equal(gather(sharded, torch.from_numpy(ids)), sharded.reference[ids])
    assert np.array_equal(gather(sharded, torch.tensor(194)), sharded.reference[194])
    assert gather(sharded, torch.empty(0, dtype=torch.int64)).shape == (0, sharded.row_bytes)


def test_a_bad_id_raises_before_anything_is_read_or_written(sharded):
    table = sharded.table
    table.config = direct()
    out = torch.full((3, sharded.row_bytes), 0xA5, dtype=torch.uint8)
    table.reset_stats()
    with pytest.raises(IndexError, match=rf"row id {NUM_ROWS} at position 2 is out of range"):
        table.gather_bytes(torch.tensor([0, 5, NUM_ROWS]), out=out)
    assert (out == 0xA5).all()
    assert table.stats()["direct_reads"] == 0


def test_direct_reads_leave_the_page_cache_alone(spread, backend):
    table = spread.table
    table.config = GatherConfig()
    table.drop_page_cache()
    path = table.paths[0]
    assert resident_pages(path) == 0, "the page cache of the table could not be dropped"
    table.config = direct(threads=2)
    ids = np.arange(0, 6000, 2)
    assert np.array_equal(gather(spread, ids), spread.reference[ids])
    assert resident_pages(path) == 0
    table.config = GatherConfig(threads=2)  # the mmap gather of the same rows fills it
    assert np.array_equal(gather(spread, ids), spread.reference[ids])
    assert resident_pages(path) > 0


def test_prefetch_and_host_tier_in_direct_mode(sharded, backend):
    fx, table = sharded, sharded.table
    table.config = direct(threads=2)
    ids = request_ids(np.random.default_rng(11), n=700)
    table.reset_stats()
    table.prefetch(torch.from_numpy(ids))
    assert np.array_equal(gather(fx, ids), fx.reference[ids])
    assert table.stats()["prefetch_hits"] == 1
    table.place(host_rows=100, first_row=50)  # read for the tier by direct reads as well
    try:
        assert np.array_equal(gather(fx, ids), fx.reference[ids])
        assert table.stats()["host_tier_hits"] == int(((ids >= 50) & (ids < 150)).sum())
    finally:
        table.place()


# Lookahead over the row cache -------------------------------------------------------

LOOKAHEAD_ROWS = 40_000


@pytest.fixture
def lookahead_table(tmp_path) -> ByteTable:
    return write_byte_table([tmp_path / "a.safetensors", tmp_path / "b.safetensors"],
                            [LOOKAHEAD_ROWS // 2] * 2, 160, seed=5, pads=(13, 1001))


def prompt_chunks(chunks: int, chunk: int, seed: int, frequent: float = 0.5) -> list[np.ndarray]:
    """A prompt's chunks of ids that repeat within a chunk and from chunk to
    chunk, as an n-gram layer's do: a share ``frequent`` of 300 frequent
    ids, the others rare."""
    rng = np.random.default_rng(seed)
    common = rng.integers(0, LOOKAHEAD_ROWS, 300)
    return [np.where(rng.random(chunk) < frequent, rng.choice(common, chunk),
                     rng.integers(0, LOOKAHEAD_ROWS, chunk)) for _ in range(chunks)]


def forward_with_lookahead(fx: ByteTable, chunks: list[np.ndarray], max_bytes: int) -> list[int]:
    """The chunks through a DiskEmbedding that looks ahead over them, each
    forward's rows equal to the NumPy reference; returns lookahead_bytes after
    each forward."""
    from ple.layers import DiskEmbedding

    layer = DiskEmbedding(fx.table, torch.float32)
    ids = torch.from_numpy(np.concatenate(chunks))
    layer.lookahead(ids, len(chunks[0]), max_bytes)
    ahead = []
    for chunk in chunks:
        got = layer(torch.from_numpy(chunk))
        assert np.array_equal(got.numpy(), fx.reference[chunk].astype(np.float32))
        ahead.append(layer.lookahead_bytes)
    assert not layer.looking_ahead
    return ahead


def test_lookahead_over_direct_io_pins_its_rows_in_the_row_cache(lookahead_table, backend):
    """Each chunk's rows are read ahead while the chunk before is gathered:
    a prefetch hit for every chunk, the rows the cache holds not read again,
    and every row read ahead held pinned in the row cache, not copied."""
    fx = lookahead_table
    fx.table.config = direct(row_cache_mib=4)
    chunks = prompt_chunks(10, 500, seed=1)
    fx.table.reset_stats()
    ahead = forward_with_lookahead(fx, chunks, max_bytes=3 * 500 * 160)
    s = fx.table.stats()
    assert (s["prefetch_hits"], s["prefetch_misses"]) == (len(chunks), 0)
    assert s["prefetch_pinned_rows"] == sum(map(len, chunks))
    # Only the ids that no chunk before had are read (each of their positions
    # a miss: a chunk's prefetch looks its rows up before it reads).
    seen, new = set(), 0
    for chunk in chunks:
        new += int(np.isin(chunk, list(seen)).__invert__().sum()) if seen else len(chunk)
        seen.update(chunk.tolist())
    assert s["row_cache_misses"] == new and s["row_cache_hits"] == sum(map(len, chunks)) - new
    assert max(ahead) <= 3 * 500 * 160


def test_lookahead_under_pressure_from_a_row_cache_smaller_than_two_chunks(lookahead_table,
                                                                           backend):
    """A 1 MiB row cache (6,553 rows of 160 B) under chunks of 4,096 ids,
    most of them rare, read up to four chunks ahead: at most half its rows
    are pinned, so each chunk's rows overflow into their prefetch's buffer,
    and the chunks gathered meanwhile evict no row a prefetch holds: every
    chunk's rows are right, and the rows read ahead stay within the bound."""
    fx = lookahead_table
    fx.table.config = direct(row_cache_mib=1)
    chunks = prompt_chunks(8, 4096, seed=2, frequent=0.1)
    max_bytes = 4 * 4096 * 160
    fx.table.reset_stats()
    ahead = forward_with_lookahead(fx, chunks, max_bytes)
    s = fx.table.stats()
    assert (s["prefetch_hits"], s["prefetch_misses"]) == (len(chunks), 0)
    assert 0 < s["prefetch_pinned_rows"] < sum(map(len, chunks))
    assert max(ahead) <= max_bytes and fx.table.prefetched_bytes() == 0


def test_a_prefetch_whose_pins_the_row_cache_lost_is_read_again(lookahead_table):
    """A row cache configured anew or emptied while a prefetch holds rows
    pinned in it: the gather that wanted them reads them itself."""
    fx = lookahead_table
    ids = prompt_chunks(1, 2000, seed=3)[0]
    for lose in (lambda: setattr(fx.table, "config", direct(row_cache_mib=2)),
                 fx.table.drop_page_cache):
        fx.table.config = direct(row_cache_mib=4)
        fx.table.prefetch(torch.from_numpy(ids))
        deadline = time.monotonic() + 10
        while fx.table.stats()["prefetch_pinned_rows"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        lose()
        fx.table.reset_stats()
        assert np.array_equal(gather(fx, ids), fx.reference[ids])
        s = fx.table.stats()
        assert (s["prefetch_hits"], s["prefetch_misses"], s["rows"]) == (0, 1, len(ids))
        fx.table.config = GatherConfig()


# The backend ------------------------------------------------------------------------

def test_the_backend_is_reported_and_an_unknown_name_refused(sharded, monkeypatch,
                                                             usable_backends):
    table = sharded.table
    table.config = GatherConfig()
    assert table.io_backend == "mmap"
    monkeypatch.delenv("PLE_IO_BACKEND", raising=False)
    table.config = direct()
    assert table.io_backend == usable_backends[0]  # the first that this process may use
    monkeypatch.setenv("PLE_IO_BACKEND", "spdk")
    with pytest.raises(ValueError, match="PLE_IO_BACKEND='spdk' is not a direct I/O backend "
                                         r"\(io_uring, aio or pread\)"):
        table.config = direct(threads=2)
    assert table.config == direct() and table.io_backend == usable_backends[0]
    assert usable_backends[-1] == "pread"  # always there


# A seccomp filter that makes the named syscalls fail with EPERM, as container
# runtimes' default profiles do for io_uring: then the table must choose the
# next backend, and read the same bytes.
SECCOMP = """
import ctypes, platform, struct
NUMBERS = {"x86_64": {"io_uring_setup": 425, "io_setup": 206},
           "aarch64": {"io_uring_setup": 425, "io_setup": 0}}[platform.machine()]

def refuse(*names):
    filters = [struct.pack("HBBI", 0x20, 0, 0, 0)]  # load the syscall number
    for name in names:  # equal: return ERRNO(EPERM); otherwise skip
        filters.append(struct.pack("HBBI", 0x15, 0, 1, NUMBERS[name]))
        filters.append(struct.pack("HBBI", 0x06, 0, 0, 0x00050000 | 1))
    filters.append(struct.pack("HBBI", 0x06, 0, 0, 0x7FFF0000))  # allow
    code = ctypes.create_string_buffer(b"".join(filters))
    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    program = Program(len(filters), ctypes.addressof(code))
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
    assert libc.prctl(22, 2, ctypes.byref(program), 0, 0) == 0, ctypes.get_errno()  # SECCOMP_MODE_FILTER
"""


@pytest.mark.parametrize("refused, chosen", [(("io_uring_setup",), "aio"),
                                             (("io_uring_setup", "io_setup"), "pread")])
def test_a_refused_io_uring_falls_back_with_the_same_bytes(tmp_path, refused, chosen):
    path = tmp_path / "t.safetensors"
    write_rows(path, 50_000)
    result = run_script(SECCOMP + f"""
t = ple.Table.from_safetensors(PATH)
ids = torch.from_numpy(np.random.default_rng(0).integers(0, t.num_rows, 5000))
refuse(*{refused!r})
t.config = ple.GatherConfig(io="direct", threads=2)
print("backend:", t.io_backend)
check(ids, t.gather_bytes(ids))
print("reads:", t.stats()["direct_reads"] > 0)
t.close()
""", path)
    expect_ok(result, f"backend: {chosen}", "reads: True")


def test_a_filesystem_that_refuses_o_direct_is_an_os_error_naming_the_file(tmp_path):
    """ramfs refuses O_DIRECT (tmpfs takes it on Linux 6.6 and newer).  Mounting
    one needs root; elsewhere the case skips."""
    mount = tmp_path / "ramfs"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "ramfs", "ramfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a ramfs here: {done.stderr.decode().strip()}")
    try:
        path = mount / "t.safetensors"
        values = torch.arange(40, dtype=torch.float32).reshape(10, 4)
        save_file({"t": values}, str(path))
        with ple.Table.from_safetensors(path) as table:
            with pytest.raises(OSError, match=rf"{path}: its filesystem refuses O_DIRECT"):
                table.config = direct()
            assert table.config == GatherConfig() and table.io_backend == "mmap"
            assert torch.equal(table.gather_bytes([3]).view(torch.float32), values[[3]])
        with pytest.raises(OSError, match=rf"{path}: its filesystem refuses O_DIRECT"):
            ple.Table.from_safetensors(path, config=direct())
    finally:
        subprocess.run(["umount", str(mount)], check=True)


# Files that change -------------------------------------------------------------------

ROWS, ROW_BYTES_160 = 50_000, 160



@pytest.mark.parametrize("threads", [1, 2])
def test_a_truncated_file_is_an_os_error_naming_file_byte_and_row(tmp_path, backend, threads):
    path = tmp_path / "t.safetensors"
    reference = write_random_rows(path, ROWS, ROW_BYTES_160)
    with ple.Table.from_safetensors(path, config=direct(threads)) as table:
        size = os.path.getsize(path)
        os.truncate(path, size // 2)
        with pytest.raises(OSError, match=rf"{path}, byte {size - ROW_BYTES_160}: row {ROWS - 1} "
                                          rf"could not be read \(the file is now {size // 2} bytes, "
                                          rf"shorter than the {size} it had when the table was "
                                          r"opened\)"):
            table.gather_bytes(torch.tensor([3, ROWS - 1, 5]))
        many = torch.from_numpy(np.random.default_rng(1).integers(0, ROWS, 4000))
        with pytest.raises(OSError, match=rf"{path}, byte \d+: row \d+ could not be read"):
            torch.ops.ple.disk_gather(many, table.handle)
        kept = torch.from_numpy(np.random.default_rng(2).integers(0, ROWS // 3, 4000))
        assert np.array_equal(table.gather_bytes(kept).numpy(), reference[kept.numpy()])


def test_a_file_replaced_or_deleted_while_open_serves_its_old_bytes(tmp_path, backend):
    path = tmp_path / "t.safetensors"
    reference = write_random_rows(path, ROWS, ROW_BYTES_160)
    ids = torch.arange(0, ROWS, 97)
    with ple.Table.from_safetensors(path) as table:
        other = tmp_path / "other.safetensors"
        save_file({"t": torch.zeros(ROWS, ROW_BYTES_160, dtype=torch.uint8)}, str(other))
        os.replace(other, path)
        table.config = direct()  # opened after the replacement: still the table's own file
        assert np.array_equal(table.gather_bytes(ids).numpy(), reference[ids.numpy()])
        os.unlink(path)
        assert np.array_equal(table.gather_bytes(ids).numpy(), reference[ids.numpy()])


# Threads and close -------------------------------------------------------------------

def test_concurrent_gathers_while_switching_io(spread, backend):
    table = spread.table
    rng = np.random.default_rng(5)
    requests = [rng.integers(0, 6000, 1500) for _ in range(4)]
    failures = []
    stop = threading.Event()

    def gather_many(k: int) -> None:
        for _ in range(6):
            ids = requests[k]
            got = table.gather_bytes(torch.from_numpy(ids)).numpy()
            if not np.array_equal(got, spread.reference[ids]):
                failures.append(k)

    def switch() -> None:
        configs = [direct(2, 8), GatherConfig(threads=2), direct(1, 0, io_queue_depth=4)]
        i = 0
        while not stop.is_set():
            table.config = configs[i % len(configs)]
            i += 1

    switcher = threading.Thread(target=switch)
    switcher.start()
    try:
        run_threads(gather_many, len(requests))
    finally:
        stop.set()
        switcher.join()
    assert not failures


def test_closing_while_other_threads_gather(tmp_path, backend):
    path = tmp_path / "t.safetensors"
    reference = write_random_rows(path, ROWS, ROW_BYTES_160)
    close_while_threads_gather(ple.Table.from_safetensors(path, config=direct(2)), reference)


# Fork and Ctrl-C ---------------------------------------------------------------------

@pytest.mark.parametrize("name", BACKENDS)
def test_forked_children_read_with_engines_of_their_own(tmp_path, name):
    """The parent's ring, AIO context and pread threads are the parent's: a
    child (forked while another thread of the parent reads) must set up its
    own on each thread that reads, and the parent must go on with its own."""
    path = tmp_path / "t.safetensors"
    write_rows(path, 100_000)
    result = run_script("""
t = ple.Table.from_safetensors(PATH, config=ple.GatherConfig(io="direct", threads=2,
                                                             row_cache_mib=1))
print("backend:", t.io_backend)
ids = torch.from_numpy(np.random.default_rng(0).integers(0, t.num_rows, 6000))
check(ids, t.gather_bytes(ids))   # the engines of this thread and the pool's exist now
stop = threading.Event()

def gather_forever():
    while not stop.is_set():
        check(ids, t.gather_bytes(ids))

background = threading.Thread(target=gather_forever)
background.start()
outcomes = []
for k in range(6):
    time.sleep(0.02)
    pid = os.fork()
    if pid == 0:
        try:
            t.config = ple.GatherConfig(io="direct", threads=2)  # no row cache: reads
            check(ids, t.gather_bytes(ids))
            t.prefetch(ids[:700])
            check(ids[:700], t.gather_bytes(ids[:700]))
            t.close()
            os._exit(0)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
    outcomes.append(wait_child(pid, 20))
stop.set()
background.join()
check(ids, t.gather_bytes(ids))
t.close()
print("children:", outcomes)
""", path, timeout=120, env={**os.environ, "PLE_IO_BACKEND": name})
    expect_ok(result, f"backend: {name}", "children: [0, 0, 0, 0, 0, 0]")


def test_ctrl_c_interrupts_a_long_direct_gather(tmp_path, backend):
    """One read at a time (io_queue_depth=1) over 65,536 pages takes seconds:
    SIGINT must end it (how soon is printed, not judged), and the reads it
    left in flight must not reach the next gather's rows."""
    path = tmp_path / "t.safetensors"
    write_rows(path, 4 << 20)
    result = run_script("""
t = ple.Table.from_safetensors(PATH, config=ple.GatherConfig(io="direct", threads=2,
                                                             io_queue_depth=1))
ids = torch.from_numpy(np.random.default_rng(1).integers(0, t.num_rows, 500_000))
interrupted(lambda: t.gather_bytes(ids), "the gather")
t.config = ple.GatherConfig(io="direct", threads=2)
few = ids[:20_000]
check(few, t.gather_bytes(few))
t.close()
print("after: ok")
""", path, timeout=120, env={**os.environ, "PLE_IO_BACKEND": backend})
    skip_if_early(result)
    expect_ok(result, "KeyboardInterrupt", "after: ok")


def test_closing_under_a_direct_prefetch_stops_its_reads(tmp_path):
    """close() while the table's prefetch reads one block at a time: the
    prefetch stops (it read far fewer bytes than its blocks), its reads in
    flight end first, and Python runs on."""
    path = tmp_path / "t.safetensors"
    write_rows(path, 4 << 20)
    result = run_script("""
from ple_tools.demo import disk_read_bytes
t = ple.Table.from_safetensors(PATH, config=ple.GatherConfig(io="direct", threads=1,
                                                             io_queue_depth=1))
ids = torch.from_numpy(np.random.default_rng(3).integers(0, t.num_rows, 500_000))
blocks = len(np.unique(ids.numpy() * 64 // 4096)) * 4096   # about: the header shifts them
read0 = disk_read_bytes()
t.prefetch(ids)
deadline = time.monotonic() + 30
while disk_read_bytes() == read0 and time.monotonic() < deadline:  # until it reads
    time.sleep(0.005)
t.close()
read = disk_read_bytes() - read0
if read >= blocks:
    print(f"EARLY: the prefetch read all {read} bytes before the close")
    sys.exit(0)
print(f"closed after {read} of {blocks} bytes")
""", path)
    skip_if_early(result)
    out = expect_ok(result, "closed after")
    read, blocks = (int(x) for x in out.split("closed after ")[1].split(" bytes")[0].split(" of "))
    assert 0 < read < blocks, out


def test_the_operators_decode_the_same_values_from_a_gguf_table(tmp_path, backend):
    """A GGUF table (the data after a header of arbitrary length) through the
    operator, decoded: the same bits in both modes."""
    import gguf

    from helpers import assert_same_bits, write_gguf

    values = np.random.default_rng(4).standard_normal((3000, 48)).astype(np.float32)
    path = tmp_path / "t.gguf"
    write_gguf(path, {"emb": (values, gguf.GGMLQuantizationType.F32)})
    ids = torch.from_numpy(np.random.default_rng(5).integers(0, 3000, (40, 25)))
    ids[0, :2] = torch.tensor([0, 2999])
    with ple.Table.from_gguf(path, "emb") as table:
        mmap_rows = torch.ops.ple.disk_gather(ids, table.handle)
        table.config = direct(threads=2, row_cache_mib=1)
        for _ in range(2):  # read, then from the row cache
            assert_same_bits(torch.ops.ple.disk_gather(ids, table.handle), mmap_rows)
    assert_same_bits(mmap_rows, torch.from_numpy(values)[ids])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_cuda_operator_reads_directly_eager_and_in_a_graph(tmp_path, backend):
    """The CUDA operator's host function (a driver thread) reads with its own
    engine into the pinned staging; eager and on every replay of a graph."""
    raw = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (5000, 160), dtype=np.uint8))
    path = tmp_path / "fp8.safetensors"
    save_file({"t": raw.view(torch.float8_e4m3fn), "t_scale": torch.tensor(0.5)}, str(path))
    with ple.Table.from_safetensors(path, config=direct(threads=2)) as table:
        def expected(ids):
            table.config = GatherConfig()
            try:
                return torch.ops.ple.disk_gather(ids, table.handle, torch.float16)
            finally:
                table.config = direct(threads=2)

        ids = torch.from_numpy(np.random.default_rng(1).integers(0, 5000, 3000))
        got = torch.ops.ple.disk_gather(ids.cuda(), table.handle, torch.float16)
        torch.testing.assert_close(got.cpu(), expected(ids), rtol=0, atol=0, equal_nan=True)
        static_ids = ids[:256].cuda()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.ops.ple.disk_gather(static_ids, table.handle, torch.float16)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = torch.ops.ple.disk_gather(static_ids, table.handle, torch.float16)
        for seed in range(2, 5):
            ids = torch.from_numpy(np.random.default_rng(seed).integers(0, 5000, 256))
            static_ids.copy_(ids)
            graph.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(static_out.cpu(), expected(ids), rtol=0, atol=0,
                                       equal_nan=True)
        assert table.stats()["direct_reads"] > 0


def test_a_signal_handler_that_gathers_during_a_direct_gather(tmp_path, backend):
    """Python runs signal handlers while a gather polls, on the gathering
    thread: a handler that gathers itself must get a reader of its own, and
    both gathers their own rows."""
    path = tmp_path / "t.safetensors"
    write_rows(path, 1 << 20)
    result = run_script("""
t = ple.Table.from_safetensors(PATH, config=ple.GatherConfig(io="direct", threads=1,
                                                             io_queue_depth=2))
few = torch.arange(0, t.num_rows, 7919)
inner, running = [], []
def handler(signum, frame):
    # Python calls a handler again from its own gather's polls when the next
    # signal comes sooner than that gather ends (a disk of 1 ms reads): one
    # level of nesting is the case, more would only recurse.
    if running:
        return
    running.append(1)
    try:
        check(few, t.gather_bytes(few))
        # the frame the signal came in: the outer gather's, when its poll ran us
        inner.append(frame.f_code.co_name == "gather_bytes")
    finally:
        running.pop()
signal.signal(signal.SIGUSR1, handler)
stop = threading.Event()
def send():
    while not stop.is_set():
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.06)
threading.Thread(target=send, daemon=True).start()
ids = torch.from_numpy(np.random.default_rng(2).integers(0, t.num_rows, 200_000))
try:
    for _ in range(3):
        check(ids, t.gather_bytes(ids))
finally:
    stop.set()
print("inner gathers during a gather:", any(inner))
""", path, timeout=120, env={**os.environ, "PLE_IO_BACKEND": backend})
    expect_ok(result, "inner gathers during a gather: True")
