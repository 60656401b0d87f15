"""A table in the life of a process: forks (with prefetches, and with gathers
running on other threads), signals (Ctrl-C in a long gather, a SIGBUS handler
replaced under one), close() from several threads or while a prefetch reads,
and the memory of an empty row cache.

Each risky case runs in a subprocess with a timeout: a hang is a failure, not
a stuck suite.  The slow cases read a table cold (policy "none", page cache
dropped), which takes seconds on the 2-core development machine; where the
disk is so fast that the gather ends before the event the case waits for,
the case skips and says so."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import ple

ROW_BYTES = 64


def write_rows(path, rows: int) -> None:
    """A U8 table of ``rows`` rows of 64 bytes: row i starts with i (int64,
    little-endian), the rest is zeros.  fsynced, so that it can be made cold."""
    a = np.zeros((rows, ROW_BYTES), dtype=np.uint8)
    a[:, :8] = np.arange(rows, dtype="<i8").view(np.uint8).reshape(rows, 8)
    save_file({"t": torch.from_numpy(a)}, str(path))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# What every script starts with: the table's path is argv[1].
PRELUDE = """
import gc, os, signal, sys, threading, time, traceback
import numpy as np, torch, ple
PATH = sys.argv[1]

# In numpy: torch's own threads (OpenMP) hang in a child forked after they ran.
def check(ids, rows):
    ids = torch.as_tensor(ids).reshape(-1).numpy()
    rows = rows.reshape(-1, rows.shape[-1]).numpy()
    assert np.array_equal(rows[:, :8].copy().view("<i8").reshape(-1), ids)
    assert not rows[:, 8:].any()

# A forked child's exit code, or "hung" (and killed) if it has not ended in `seconds`.
def wait_child(pid, seconds):
    deadline = time.monotonic() + seconds
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "hung"
        time.sleep(0.01)

# Runs call() with a SIGINT sent 0.5 s in, and prints how soon after the signal
# the KeyboardInterrupt came; if call() returns first, prints EARLY and exits.
def interrupted(call, what):
    sent = []

    def send():
        time.sleep(0.5)
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=send).start()
    start = time.monotonic()
    try:
        call()
    except KeyboardInterrupt:
        while not sent:
            time.sleep(0.01)
        print(f"{what}: KeyboardInterrupt {time.monotonic() - sent[0]:.3f} s after the signal")
        return
    print(f"EARLY: {what} returned after {time.monotonic() - start:.2f} s")
    sys.exit(0)
"""


def run_script(body: str, path, timeout: float = 60, env: dict | None = None):
    """Runs PRELUDE + body in a fresh interpreter with argv[1] = path."""
    script = PRELUDE + textwrap.dedent(body)
    try:
        return subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True,
                              text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as expired:
        out = expired.stdout.decode() if isinstance(expired.stdout, bytes) else expired.stdout
        err = expired.stderr.decode() if isinstance(expired.stderr, bytes) else expired.stderr
        pytest.fail(f"hung: no end within {timeout} s\nstdout: {out}\nstderr: {(err or '')[-3000:]}")


def expect_ok(result, *needles: str) -> str:
    assert result.returncode == 0, (result.returncode, result.stdout[-2000:], result.stderr[-3000:])
    for needle in needles:
        assert needle in result.stdout, (needle, result.stdout[-2000:], result.stderr[-3000:])
    return result.stdout


def skip_if_early(result) -> None:
    if "EARLY" in result.stdout:
        pytest.skip("the cold gather ended before the event the case needs: this disk is too "
                    "fast for it (" + result.stdout.strip().splitlines()[-1] + ")")


@pytest.fixture(scope="module")
def small_table(tmp_path_factory):
    path = tmp_path_factory.mktemp("small") / "t.safetensors"
    write_rows(path, 20_000)
    return path


# 4,194,304 rows of 64 B: 65,536 pages, which take about 5 s to read cold with
# policy "none" here (one synchronous fault a page).
COLD_ROWS = 4 << 20


@pytest.fixture(scope="module")
def cold_table(tmp_path_factory):
    path = tmp_path_factory.mktemp("cold") / "t.safetensors"
    write_rows(path, COLD_ROWS)
    return path


# Fork -------------------------------------------------------------------------

def test_a_forked_child_prefetches_gathers_and_closes(small_table):
    """The parent's prefetch thread does not survive a fork: the child's
    prefetch must start its own, and close() must not wait for the old one."""
    result = run_script("""
        t = ple.Table.from_safetensors(PATH)
        ids = torch.arange(0, 19_000, 7)
        t.prefetch(ids)
        check(ids, t.gather_bytes(ids))   # the prefetch thread runs now
        t.prefetch(ids + 1)               # and a prefetch is pending at the fork

        def child(work):
            pid = os.fork()
            if pid == 0:
                try:
                    work()
                    os._exit(0)
                except BaseException:
                    traceback.print_exc()
                    os._exit(1)
            _, status = os.waitpid(pid, 0)
            return os.waitstatus_to_exitcode(status)

        def prefetch_gather_close():
            t.prefetch(ids)
            check(ids, t.gather_bytes(ids))
            check(ids + 1, t.gather_bytes(ids + 1))
            assert t.stats()["prefetch_hits"] >= 1
            t.close()

        print("prefetch, gather, close:", child(prefetch_gather_close))
        print("close:", child(t.close))
        check(ids + 1, t.gather_bytes(ids + 1))   # the parent's pending prefetch
        t.prefetch(ids)
        check(ids, t.gather_bytes(ids))
        t.close()
        print("parent ok")
    """, small_table)
    expect_ok(result, "prefetch, gather, close: 0", "close: 0", "parent ok")


def test_a_forked_child_of_a_process_mid_plan_gathers_and_ends_it(small_table):
    """A fork while a plan reads ahead (Table.plan_prefetches, a layer's
    lookahead): the child's gathers of the coming chunks get their rows (of
    the prefetches done at the fork, or read), its end_plan leaves nothing
    read ahead nor pinned; the parent's plan goes on, every chunk a hit."""
    result = run_script("""
        from ple.kernels.native import native
        t = ple.Table.from_safetensors(PATH, config=ple.GatherConfig(row_cache_mib=1))
        owner = 7
        chunks = [torch.arange(k * 500, (k + 1) * 500) * 3 for k in range(6)]
        t.plan_prefetches(owner, chunks, 2 * 500 * 64)
        check(chunks[0], t.gather_bytes(chunks[0], owner=owner))

        pid = os.fork()
        if pid == 0:
            try:
                for chunk in chunks[1:]:
                    check(chunk, t.gather_bytes(chunk, owner=owner))
                t.end_plan(owner)
                assert t.prefetched_bytes() == 0 and not t.planning(owner)
                assert native.row_cache_pinned_rows(t._native) == 0
                os._exit(0)
            except BaseException:
                traceback.print_exc()
                os._exit(1)
        print("child:", wait_child(pid, 30))
        t.reset_stats()
        for chunk in chunks[1:]:
            check(chunk, t.gather_bytes(chunk, owner=owner))
        print("parent hits:", t.stats()["prefetch_hits"], t.prefetched_bytes(), t.planning(owner))
    """, small_table)
    expect_ok(result, "child: 0", "parent hits: 5 0 False")


def test_multiprocessing_fork_and_dataloader_workers_gather_from_the_parents_table(small_table):
    result = run_script("""
        import multiprocessing as mp
        from torch.utils.data import DataLoader, Dataset

        t = ple.Table.from_safetensors(PATH)
        ids = torch.arange(0, 19_000, 11)
        t.prefetch(ids)
        check(ids, t.gather_bytes(ids))
        t.prefetch(ids)

        def work(queue):
            t.prefetch(ids + 3)
            check(ids + 3, t.gather_bytes(ids + 3))
            t.close()
            queue.put("done")

        ctx = mp.get_context("fork")
        queue = ctx.Queue()
        p = ctx.Process(target=work, args=(queue,))
        p.start()
        p.join(30)
        print("process:", p.exitcode, queue.get(timeout=5) if p.exitcode == 0 else None)

        class Rows(Dataset):
            def __len__(self):
                return 16
            def __getitem__(self, i):
                want = torch.arange(i * 1000, i * 1000 + 600)
                t.prefetch(want)
                rows = t.gather_bytes(want)
                check(want, rows)
                return rows

        loader = DataLoader(Rows(), batch_size=2, num_workers=2, multiprocessing_context="fork",
                            timeout=30)
        print("batches:", sum(1 for _ in loader))
        check(ids, t.gather_bytes(ids))
        t.close()
    """, small_table, timeout=90)
    expect_ok(result, "process: 0 done", "batches: 8")


def test_fork_while_another_thread_gathers(small_table):
    """A fork copies the locks of the parent's gathers as they were: the
    child of a fork made while another thread was inside a gather must still
    gather (with threads), prefetch and close."""
    result = run_script("""
        t = ple.Table.from_safetensors(PATH, config=ple.GatherConfig(threads=2))
        t.config = ple.GatherConfig(threads=2, row_cache_mib=1)
        ids = torch.from_numpy(np.random.default_rng(0).integers(0, 20_000, 4096))
        stop = threading.Event()

        def gather_forever():
            while not stop.is_set():
                t.gather_bytes(ids)
                t.prefetch(ids)

        background = threading.Thread(target=gather_forever)
        background.start()
        time.sleep(0.1)
        outcomes = []
        for _ in range(10):
            time.sleep(0.01)
            pid = os.fork()
            if pid == 0:
                try:
                    check(ids, t.gather_bytes(ids))
                    t.prefetch(ids[:600])
                    check(ids[:600], t.gather_bytes(ids[:600]))
                    t.config = ple.GatherConfig(threads=2, row_cache_mib=2)
                    check(ids, t.gather_bytes(ids))
                    t.close()
                    os._exit(0)
                except BaseException:
                    traceback.print_exc()
                    os._exit(1)
            outcomes.append(wait_child(pid, 10))
        stop.set()
        background.join()
        t.close()
        print("children:", outcomes)
    """, small_table, timeout=150)
    out = expect_ok(result, "children:")
    assert "children: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0]" in out, out


def test_a_forked_child_gives_back_the_row_cache_pins_of_the_parents_prefetch(cold_table):
    """The prefetch being read at a fork is the parent's thread's, which the
    child does not have: nothing in the child would give back the row-cache
    slots it pinned.  The child starts with no slot pinned, gathers the
    right bytes, and its own prefetches pin and give back as usual."""
    result = run_script("""
        from ple.kernels.native import native
        t = ple.Table.from_safetensors(PATH)
        t.config = ple.GatherConfig("none", 0, 1, row_cache_mib=64)
        h = t._native_handle()
        ids = torch.arange(0, t.num_rows, 16)   # 262,144 rows on 65,536 pages
        t.drop_page_cache()
        few = ids[:5000]
        check(few, t.gather_bytes(few))   # cached: the prefetch pins them first, then reads cold
        t.prefetch(ids)
        deadline = time.monotonic() + 10
        while native.row_cache_pinned_rows(h) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        pinned_at_fork = native.row_cache_pinned_rows(h)
        pid = os.fork()
        if pid == 0:
            try:
                assert native.row_cache_pinned_rows(h) == 0, native.row_cache_pinned_rows(h)
                check(few, t.gather_bytes(few))
                t.prefetch(few)
                while t.prefetched_bytes() and native.row_cache_pinned_rows(h) < few.numel():
                    time.sleep(0.01)
                assert native.row_cache_pinned_rows(h) == few.numel()
                check(few, t.gather_bytes(few))
                assert native.row_cache_pinned_rows(h) == 0
                os._exit(0)
            except BaseException:
                traceback.print_exc()
                os._exit(1)
        print("child:", wait_child(pid, 60))
        if not 0 < pinned_at_fork < ids.numel():
            print(f"EARLY: {pinned_at_fork} rows pinned at the fork")
        t.close()
    """, cold_table, timeout=120)
    skip_if_early(result)
    expect_ok(result, "child: 0")


# Signals ------------------------------------------------------------------------

LONG_GATHER = """
    t = ple.Table.from_safetensors(PATH, config=ple.GatherConfig("none", 0, 2))
    ids = torch.from_numpy(np.random.default_rng(1).integers(0, t.num_rows, 500_000))
"""


def test_ctrl_c_interrupts_a_long_gather(cold_table):
    result = run_script(LONG_GATHER + """
    t.drop_page_cache()
    interrupted(lambda: t.gather_bytes(ids), "gather_bytes")
    t.drop_page_cache()
    interrupted(lambda: torch.ops.ple.disk_gather(ids, t.handle), "disk_gather")
    t.prefetch(ids)
    t.drop_page_cache()
    interrupted(lambda: t.gather_bytes(ids), "a gather waiting for its prefetch")
    few = torch.arange(0, t.num_rows, 4099)
    check(few, t.gather_bytes(few))   # the table still works
    check(ids[:1000], t.gather_bytes(ids[:1000]))
    start = time.monotonic()
    t.close()
    print(f"closed in {time.monotonic() - start:.3f} s")
    """, cold_table)
    skip_if_early(result)
    out = expect_ok(result, "closed in")
    latencies = [float(line.split("KeyboardInterrupt ")[1].split()[0])
                 for line in out.splitlines() if "KeyboardInterrupt" in line]
    assert len(latencies) == 3, out
    assert max(latencies) < 1.0, out


def test_a_python_signal_handler_that_does_not_raise_lets_the_gather_finish(small_table):
    result = run_script("""
        t = ple.Table.from_safetensors(PATH, config=ple.GatherConfig("none", 0, 2))
        seen = []
        signal.signal(signal.SIGUSR1, lambda *_: seen.append(1))
        ids = torch.from_numpy(np.random.default_rng(2).integers(0, t.num_rows, 400_000))
        threading.Timer(0.05, lambda: os.kill(os.getpid(), signal.SIGUSR1)).start()
        for _ in range(4):
            check(ids, t.gather_bytes(ids))
        time.sleep(0.2)
        print("handled", len(seen))
    """, small_table)
    expect_ok(result, "handled 1")


@pytest.mark.parametrize("replacement", ["SIG_DFL", "python"])
def test_a_sigbus_handler_replaced_during_a_gather(tmp_path, replacement):
    """Another handler takes SIGBUS while a gather runs (after it made sure of
    its own), then a page of the file goes away: an OSError, not a dead
    process (SIG_DFL) or a gather that never returns (a Python handler, which
    returns to the faulting copy).

    The gather reads a row on each of 32,768 cold pages, then rows of the last
    MiB, which the truncation takes away.  The handler is replaced once the
    gather has begun; the case holds only if the gather then still had the
    last 512 of those pages to read (none of them resident just after the
    truncation), so that it went by a handler check (every 256 rows) before
    it came to the missing pages.  A gather closer to the end than that
    could meet them under the other handler, which no check can prevent."""
    path = tmp_path / "t.safetensors"
    rows = 33 << 16  # 132 MiB
    write_rows(path, rows)
    handler = "signal.SIG_DFL" if replacement == "SIG_DFL" else "lambda *_: None"
    result = run_script(f"""
        from helpers import resident_pages
        t = ple.Table.from_safetensors(PATH, config=ple.GatherConfig("none", 0, 1))
        t.gather_bytes(torch.tensor([0]))   # the gather's handler is in
        t.drop_page_cache()
        rows = t.num_rows
        size = os.path.getsize(PATH)
        data = size - rows * 64
        pages = 32768
        ids = torch.cat([torch.arange(0, pages * 64, 64), torch.arange(rows - 16384, rows, 97)])
        outcome = []

        def gather():
            try:
                t.gather_bytes(ids)
                outcome.append("returned")
            except OSError as error:
                outcome.append(f"OSError: {{error}}")

        worker = threading.Thread(target=gather, daemon=True)
        worker.start()
        deadline = time.monotonic() + 10
        while resident_pages(PATH, data, data + 16 * 4096) == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        signal.signal(signal.SIGBUS, {handler})
        os.truncate(PATH, size - (2 << 20))
        near_end = resident_pages(PATH, data + (pages - 512) * 4096, data + pages * 4096)
        worker.join(50)
        if outcome == ["returned"] or near_end:
            print(f"EARLY: the gather was {{'done' if outcome == ['returned'] else 'near the end'}}"
                  " when the handler was replaced")
        print("outcome:", outcome or "hung")
        sys.stdout.flush()
        os._exit(0)
    """, path, timeout=90, env={**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))})
    skip_if_early(result)
    expect_ok(result, "outcome: ['OSError:", "could not be read")


# close() ---------------------------------------------------------------------------

def test_close_from_several_threads_at_once(small_table):
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # interleave the threads as much as possible
    errors = []
    try:
        for _ in range(150):
            table = ple.Table.from_safetensors(small_table)
            barrier = threading.Barrier(6)

            def close():
                barrier.wait()
                try:
                    table.close()
                except BaseException as error:  # noqa: BLE001
                    errors.append(repr(error))

            threads = [threading.Thread(target=close) for _ in range(6)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            with pytest.raises(ValueError, match="closed"):
                table.handle
    finally:
        sys.setswitchinterval(previous)
    assert errors == []


@pytest.mark.parametrize("how", ["close", "del"])
def test_closing_under_a_cold_prefetch_leaves_python_running(cold_table, how):
    """close() (or the garbage collector) while the table's prefetch reads
    cold rows: the other threads run on, and the close does not wait for the
    whole prefetch."""
    end = "t.close()" if how == "close" else "del t; gc.collect()"
    result = run_script(f"""
        t = ple.Table.from_safetensors(PATH, config=ple.GatherConfig("none", 0, 2))
        ids = torch.from_numpy(np.random.default_rng(3).integers(0, t.num_rows, 500_000))
        t.drop_page_cache()
        t.prefetch(ids)
        ticks, stop = [], threading.Event()

        def tick():
            while not stop.is_set():
                ticks.append(time.monotonic())
                time.sleep(0.005)

        ticker = threading.Thread(target=tick)
        ticker.start()
        time.sleep(0.5)
        start = time.monotonic()
        {end}
        took = time.monotonic() - start
        time.sleep(0.05)
        stop.set()
        ticker.join()
        during = [b - a for a, b in zip(ticks, ticks[1:]) if b > start]
        print(f"close took {{took:.3f}} s; longest pause of the ticker {{max(during):.3f}} s")
    """, cold_table)
    out = expect_ok(result, "close took")
    took = float(out.split("close took ")[1].split()[0])
    pause = float(out.split("longest pause of the ticker ")[1].split()[0])
    assert took < 1.0 and pause < 0.5, out


# The row cache ----------------------------------------------------------------------

def test_an_empty_row_cache_costs_no_memory(small_table):
    result = run_script("""
        def anon_mib():
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("RssAnon:"):
                        return int(line.split()[1]) / 1024

        t = ple.Table.from_safetensors(PATH)
        ids = torch.arange(0, 20_000, 3)
        t.gather_bytes(ids)
        before = anon_mib()
        t.config = ple.GatherConfig(row_cache_mib=1024)
        empty = anon_mib()
        t.gather_bytes(ids)
        t.gather_bytes(ids)
        filled = anon_mib()
        assert t.stats()["row_cache_hits"] == ids.numel()
        t.config = ple.GatherConfig(row_cache_mib=2048)
        again = anon_mib()
        print(f"empty {empty - before:.1f} MiB; {ids.numel()} rows {filled - before:.1f} MiB; "
              f"re-budgeted {again - before:.1f} MiB")
    """, small_table)
    out = expect_ok(result, "empty")
    empty = float(out.split("empty ")[1].split()[0])
    filled = float(out.split("rows ")[1].split()[0])
    again = float(out.split("re-budgeted ")[1].split()[0])
    # 6,667 rows of 64 B are 0.4 MiB; a few pages of index each way.
    assert empty < 4 and filled < 8 and again < 8, out


class ClockModel:
    """The row cache's rule (row_cache.h): a gather looks every disk id up
    first (a hit marks its slot), then caches the misses in request order
    (a duplicate once); slots fill in order, then CLOCK evicts."""

    def __init__(self, capacity: int):
        self.capacity, self.used, self.hand = capacity, 0, 0
        self.slot_id, self.referenced, self.where = [0] * capacity, [0] * capacity, {}

    def gather(self, ids) -> int:
        misses, hits = [], 0
        for i in ids:
            slot = self.where.get(i)
            if slot is None:
                misses.append(i)
            else:
                self.referenced[slot] = 1
                hits += 1
        for i in misses:
            if i in self.where:
                continue
            if self.used < self.capacity:
                slot, self.used = self.used, self.used + 1
            else:
                while self.referenced[self.hand]:
                    self.referenced[self.hand] = 0
                    self.hand = (self.hand + 1) % self.capacity
                slot, self.hand = self.hand, (self.hand + 1) % self.capacity
                del self.where[self.slot_id[slot]]
            self.slot_id[slot], self.referenced[slot], self.where[i] = i, 0, slot
        return hits


def test_the_row_cache_hits_as_clock_says_while_it_evicts(small_table):
    """1 MiB holds 16,384 rows of 64 B; gathers of up to 16,384 rows (with
    duplicates) over 20,000 evict all the time: every gather's hits are the
    model's, and its bytes the file's."""
    rng = np.random.default_rng(7)
    model = ClockModel(16_384)
    with ple.Table.from_safetensors(small_table, config=ple.GatherConfig(row_cache_mib=1)) as table:
        for _ in range(60):
            ids = torch.from_numpy(rng.integers(0, 20_000, int(rng.integers(1, 16_384))))
            table.reset_stats()
            rows = table.gather_bytes(ids)
            assert table.stats()["row_cache_hits"] == model.gather(ids.tolist())
            assert torch.equal(rows[:, :8].contiguous().view(torch.int64).reshape(-1), ids)
            assert not rows[:, 8:].any()


def test_a_row_cache_of_more_rows_than_it_can_number_cannot_be_had(small_table):
    """2**32 rows of 64 B (256 GiB): a MemoryError wherever memory is
    overcommitted too (the mapping would succeed there)."""
    with ple.Table.from_safetensors(small_table) as table:
        table.config = ple.GatherConfig(row_cache_mib=1)
        ids = torch.arange(0, 20_000, 5)
        table.gather_bytes(ids)
        with pytest.raises(MemoryError):
            table.config = ple.GatherConfig(row_cache_mib=(64 << 32) >> 20)
        table.reset_stats()
        table.gather_bytes(ids)
        assert table.stats()["row_cache_hits"] == ids.numel()


# The threads cap ----------------------------------------------------------------------

def test_the_native_side_caps_threads(small_table):
    from ple.kernels.native import native

    assert native.MAX_THREADS == 256
    with ple.Table.from_safetensors(small_table) as table:
        args = list(ple.GatherConfig(threads=256)._native_args())
        native.configure(table._native_handle(), *args)
        args[list(ple.config.FIELDS).index("threads")] = 257
        with pytest.raises(ValueError, match="threads must be at most 256"):
            native.configure(table._native_handle(), *args)
        config = getattr(ple.config, "MAX_THREADS", None)
        if config is not None:
            assert config == native.MAX_THREADS


# CUDA ---------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_a_forked_child_of_a_cuda_process_gathers_on_cpu_and_closes(small_table):
    """The parent used the CUDA operator (pinned staging, host functions): its
    child must not touch that CUDA state, yet gather, prefetch and close."""
    result = run_script("""
        t = ple.Table.from_safetensors(PATH)
        ids = torch.arange(0, 20_000, 13)
        rows = torch.ops.ple.disk_gather(ids.cuda(), t.handle)
        torch.cuda.synchronize()
        check(ids, rows.cpu().to(torch.uint8))
        t.prefetch(ids)
        pid = os.fork()
        if pid == 0:
            try:
                check(ids, t.gather_bytes(ids))
                t.prefetch(ids + 1)
                check(ids + 1, t.gather_bytes(ids + 1))
                t.close()
                os._exit(0)
            except BaseException:
                traceback.print_exc()
                os._exit(1)
        _, status = os.waitpid(pid, 0)
        print("child:", os.waitstatus_to_exitcode(status))
        check(ids, torch.ops.ple.disk_gather(ids.cuda(), t.handle).cpu().to(torch.uint8))
        t.close()
    """, small_table)
    expect_ok(result, "child: 0")


@cuda
def test_ctrl_c_during_a_cuda_gather(cold_table):
    """The host function cannot raise: it finishes, the KeyboardInterrupt
    comes once Python runs again, and the next call works with no error left."""
    result = run_script("""
        t = ple.Table.from_safetensors(PATH, config=ple.GatherConfig("none", 0, 2))
        ids = torch.from_numpy(np.random.default_rng(4).integers(0, t.num_rows, 1_000_000))
        few = torch.arange(0, t.num_rows, 4099)
        torch.ops.ple.disk_gather(few.cuda(), t.handle)   # compiles, stages
        torch.cuda.synchronize()
        t.drop_page_cache()
        threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        try:
            rows = torch.ops.ple.disk_gather(ids.cuda(), t.handle)
            torch.cuda.synchronize()
            time.sleep(2)
            print("no interrupt")
        except KeyboardInterrupt:
            print("interrupted")
        torch.cuda.synchronize()
        out = torch.ops.ple.disk_gather(few.cuda(), t.handle)
        check(few, out.cpu().to(torch.uint8))
        t.close()
        print("works after")
    """, cold_table)
    expect_ok(result, "interrupted", "works after")
