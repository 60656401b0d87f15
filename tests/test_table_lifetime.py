"""place() and close() while other threads gather: each gather reads one
snapshot of the tiers, kept in memory until it is done, so that it gives
the right bytes of the old or the new placement, or a clear error; a
place() that fails keeps the tiers it would have replaced.  README
"Reliability"."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch

import ple
from helpers import REPO, close_while_threads_gather, write_random_rows

ROWS = 20_000


@pytest.fixture
def table_and_rows(tmp_path):
    reference = write_random_rows(tmp_path / "rows.safetensors", rows=ROWS, row_bytes=64)
    table = ple.Table.from_safetensors(tmp_path / "rows.safetensors")
    yield table, reference
    table.close()


def place_while_threads_gather(table: ple.Table, reference: np.ndarray, read, placements,
                               threads: int) -> list[str]:
    """Runs ``table.place(**p)`` for each of ``placements`` while ``threads``
    threads gather random rows with ``read(ids)`` (the rows' bytes, as a
    NumPy array); what each thread found."""
    stop, outcomes = threading.Event(), []

    def gather(k: int) -> None:
        rng = np.random.default_rng(k)
        while not stop.is_set():
            ids = torch.from_numpy(rng.integers(0, ROWS, 5000))
            try:
                rows = read(ids)
            except Exception as error:  # noqa: BLE001 (reported by the caller's assertion)
                outcomes.append(repr(error))
                return
            if not np.array_equal(rows, reference[ids.numpy()]):
                outcomes.append("wrong bytes")
                return
        outcomes.append("right bytes")

    workers = [threading.Thread(target=gather, args=(k,)) for k in range(threads)]
    for worker in workers:
        worker.start()
    for placement in placements:
        table.place(**placement)
    stop.set()
    for worker in workers:
        worker.join(timeout=120)
    return outcomes


def test_place_while_threads_gather_gives_every_gather_the_right_bytes(table_and_rows):
    table, reference = table_and_rows
    placements = [{"host_rows": (k % 4) * 3000, "first_row": (k * 997) % 5000}
                  for k in range(40)]  # other rows, and none, as the gathers run
    outcomes = place_while_threads_gather(
        table, reference, lambda ids: table.gather_bytes(ids).numpy(), placements, threads=4)
    assert outcomes == ["right bytes"] * 4


def test_close_while_threads_gather_with_a_host_tier(table_and_rows):
    table, reference = table_and_rows
    table.place(host_rows=ROWS // 2, first_row=ROWS // 4)
    close_while_threads_gather(table, reference)


def test_a_place_that_fails_keeps_the_old_tiers(table_and_rows, monkeypatch):
    table, reference = table_and_rows
    table.place(host_rows=100, first_row=10)
    old = table.tiers

    def no_memory(*args, **kwargs):
        raise MemoryError("no room for the tiers")

    monkeypatch.setattr(ple.table, "Tiers", no_memory)
    with pytest.raises(MemoryError, match="no room for the tiers"):
        table.place(host_rows=5000)
    assert table.tiers is old and table.resident_range == (10, 110)
    ids = torch.arange(0, 200)
    assert np.array_equal(table.gather_bytes(ids).numpy(), reference[:200])
    assert table.stats()["host_tier_hits"] == 100


def test_tiers_that_a_place_replaces_are_freed(table_and_rows):
    table, reference = table_and_rows
    table.place(host_rows=100)
    first = table.tiers
    table.place(host_rows=50, first_row=7)
    assert first.host_table is None and first.calls == 0
    assert np.array_equal(table.gather_bytes(torch.arange(100)).numpy(), reference[:100])


def test_tiers_replaced_during_a_gather_are_freed_when_it_ends(table_and_rows):
    table, _ = table_and_rows
    table.place(host_rows=100)
    handle, tiers = table.acquire()  # a gather in progress
    table.place()
    assert tiers.host_table is not None  # still readable by that gather
    table.release(tiers)
    assert tiers.host_table is None


def test_a_close_during_a_gather_finishes_when_it_ends(table_and_rows):
    table, _ = table_and_rows
    table.place(host_rows=100)
    handle, tiers = table.acquire()
    table.close()
    with pytest.raises(ValueError, match=r"ple table 't' \(handle t@[0-9a-f]{16}\) is closed"):
        table.acquire()
    assert tiers.host_table is not None
    table.release(tiers)
    assert tiers.host_table is None and table.tiers is None


def test_interpreter_exit_with_open_tables_says_nothing(tmp_path):
    write_random_rows(tmp_path / "rows.safetensors", rows=100, row_bytes=64)
    script = textwrap.dedent("""
        import sys, ple
        from ple.layers import DiskEmbedding
        kept = [ple.Table.from_safetensors(sys.argv[1]) for _ in range(3)]
        kept[0].place(host_rows=10)
        module = DiskEmbedding.from_safetensors(sys.argv[1])
    """)
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "rows.safetensors")],
                          capture_output=True, text=True, timeout=120, cwd=REPO / "tests")
    assert (done.returncode, done.stderr) == (0, "")


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
def test_place_while_threads_gather_on_cuda_gives_every_gather_the_right_bytes(table_and_rows):
    table, reference = table_and_rows

    def read(ids: torch.Tensor) -> np.ndarray:  # a U8 table's values are its bytes
        with torch.cuda.stream(torch.cuda.Stream()):
            rows = torch.ops.ple.disk_gather(ids.cuda(), table.handle, torch.float32)
            return rows.cpu().numpy().astype(np.uint8)

    placements = [{"device_rows": (k % 3) * 2000, "host_rows": (k % 4) * 2000,
                   "first_row": (k * 997) % 5000} for k in range(30)]
    assert place_while_threads_gather(table, reference, read, placements,
                                      threads=3) == ["right bytes"] * 3


@cuda
def test_a_cuda_graph_holds_the_str_handle_and_its_tiers(table_and_rows):
    table, reference = table_and_rows
    table.place(device_rows=100, host_rows=100)
    ids = torch.arange(0, 300, device="cuda")
    graph = torch.cuda.CUDAGraph()
    torch.ops.ple.disk_gather(ids, table.handle, torch.float32)  # warm up outside the capture
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out = torch.ops.ple.disk_gather(ids, table.handle, torch.float32)
    table.place()  # the graph keeps reading the tiers it captured
    graph.replay()
    torch.cuda.synchronize()
    assert np.array_equal(out.cpu().numpy(), reference[:300].astype(np.float32))
