"""The host gather of a captured CUDA graph, rung by a doorbell
(kernels/doorbell_gather.cpp) and, where stream memory operations are
missing or PLE_GRAPH_GATHER=host_func, run by a host node: replays with new
ids equal the eager operator either way, with tiers and prefetch and on two
streams; a failed gather gives NaN, the next call raises and the doorbell is
answered again; a forked child, the process's exit (the doorbell thread
asleep, or a replay still waiting for its ring) and a close while a replay
waits do not hang; the doorbell thread sleeps once no graph runs; replays
after a pause are answered by their wake-up node, gathers late in a graph
too (the node runs beside their ids' copy), and replays back to back by the
doorbell thread, each ring once.  Skipped without a GPU; the cases that
could hang run in a subprocess with a timeout.  (The protocol itself, on
the CPU: tests/test_doorbell_protocol.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
import ple
from helpers import write_fp8_table
from ple.kernels.native import native

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

NUM_ROWS = 5000
MECHANISMS = ("doorbell", "host_func")


@pytest.fixture
def table_path(tmp_path):
    return write_fp8_table(tmp_path / "fp8.safetensors", NUM_ROWS)


@pytest.fixture
def table(table_path):
    with ple.Table.from_safetensors(table_path) as opened:
        yield opened


@pytest.fixture(params=MECHANISMS)
def mechanism(request, monkeypatch):
    if request.param == "host_func":
        monkeypatch.setenv("PLE_GRAPH_GATHER", "host_func")
    else:
        monkeypatch.delenv("PLE_GRAPH_GATHER", raising=False)
    return request.param


def random_ids(shape, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, NUM_ROWS, shape))


def capture_gather(table, static_ids: torch.Tensor, dtype=torch.bfloat16):
    """A graph of the operator on static_ids, and its output."""
    torch.ops.ple.disk_gather(static_ids, table.handle, dtype)  # compiles the kernel
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.ple.disk_gather(static_ids, table.handle, dtype)
    return graph, out


def assert_same(gpu: torch.Tensor, cpu: torch.Tensor) -> None:
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=0, atol=0, equal_nan=True)


def test_the_mechanism_of_this_machine(monkeypatch):
    monkeypatch.delenv("PLE_GRAPH_GATHER", raising=False)
    assert native.graph_gather_mechanism() == "doorbell"  # CUDA 12 and later drivers have memory ops
    monkeypatch.setenv("PLE_GRAPH_GATHER", "host_func")
    assert native.graph_gather_mechanism() == "host_func"


@pytest.mark.parametrize("n", (16, 3000))
def test_replays_with_new_ids(table, mechanism, n):
    static_ids = random_ids((n,), 0).cuda()
    graph, out = capture_gather(table, static_ids)
    for seed in range(1, 8):
        ids = random_ids((n,), seed)
        static_ids.copy_(ids)
        graph.replay()
        assert_same(out, torch.ops.ple.disk_gather(ids, table.handle, torch.bfloat16))


def test_replays_with_tiers_and_prefetch(table, mechanism):
    table.place(device_rows=NUM_ROWS // 3, host_rows=NUM_ROWS // 3, device="cuda")
    static_ids = random_ids((2048,), 0).cuda()
    graph, out = capture_gather(table, static_ids)
    for seed in range(1, 4):
        ids = random_ids((2048,), seed)
        table.prefetch(ids)
        static_ids.copy_(ids)
        graph.replay()
        assert_same(out, torch.ops.ple.disk_gather(ids, table.handle, torch.bfloat16))
    torch.cuda.synchronize()
    assert table.stats()["prefetch_hits"] >= 1


def test_graphs_on_two_streams(table, mechanism):
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    captured = []
    for k, stream in enumerate(streams):
        with torch.cuda.stream(stream):
            static_ids = random_ids((512,), k).cuda()
            captured.append((static_ids, *capture_gather(table, static_ids)))
    for seed in range(10, 16):
        expected = []
        for k, (stream, (static_ids, graph, _)) in enumerate(zip(streams, captured)):
            ids = random_ids((512,), seed + 100 * k)
            expected.append(torch.ops.ple.disk_gather(ids, table.handle, torch.bfloat16))
            with torch.cuda.stream(stream):
                static_ids.copy_(ids)
                graph.replay()
        torch.cuda.synchronize()
        for (_, _, out), want in zip(captured, expected):
            assert_same(out, want)


def doorbell_cpu_ms_per_s(seconds: float) -> float:
    """The doorbell thread's CPU time per second over the next ``seconds``."""
    from ple_tools.bench_gpu import DOORBELL_THREAD, thread_cpu_ns

    before, start = thread_cpu_ns(DOORBELL_THREAD), time.perf_counter()
    assert before is not None, "no thread is named ple-doorbell"
    time.sleep(seconds)
    return (thread_cpu_ns(DOORBELL_THREAD) - before) / 1e6 / (time.perf_counter() - start)


def test_the_doorbell_thread_sleeps_when_no_graph_runs(table, monkeypatch):
    monkeypatch.delenv("PLE_GRAPH_GATHER", raising=False)
    static_ids = random_ids((16,), 0).cuda()
    graph, _ = capture_gather(table, static_ids)
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    time.sleep(0.1)  # past the spin after the last ring
    used = doorbell_cpu_ms_per_s(1.0)
    assert used < 1.0, f"the doorbell thread took {used:.2f} ms of CPU a second while no graph ran"


def answers_since(before: dict) -> dict:
    """The doorbell counts (native.doorbell_counts) since ``before``."""
    return {key: value - before[key] for key, value in native.doorbell_counts().items()}


@pytest.mark.parametrize("pause_s", (0.02, 0.3))
def test_replays_after_a_pause(table, monkeypatch, pause_s):
    """The first replay after a pause finds the doorbell thread asleep: its
    wake-up node answers the ring itself."""
    monkeypatch.delenv("PLE_GRAPH_GATHER", raising=False)
    static_ids = random_ids((16,), 0).cuda()
    graph, out = capture_gather(table, static_ids)
    before = native.doorbell_counts()
    for seed in range(1, 5):
        time.sleep(pause_s)
        ids = random_ids((16,), seed)
        static_ids.copy_(ids)
        graph.replay()
        assert_same(out, torch.ops.ple.disk_gather(ids, table.handle, torch.bfloat16))
    answers = answers_since(before)
    assert answers["by_node"] + answers["by_thread"] == 4, answers
    assert answers["by_node"] >= 1 and answers["thread_wakes"] == 0, answers


def test_replays_back_to_back_are_each_answered_once(table, monkeypatch):
    """Which of the thread and the node answers a ring depends on timing (the
    benchmark reports the split): each ring is answered once, with the rows."""
    monkeypatch.delenv("PLE_GRAPH_GATHER", raising=False)
    static_ids = random_ids((16,), 0).cuda()
    graph, out = capture_gather(table, static_ids)
    time.sleep(0.01)
    before = native.doorbell_counts()
    for _ in range(50):
        graph.replay()
        torch.cuda.synchronize()
    answers = answers_since(before)
    assert answers["by_node"] + answers["by_thread"] == 50, answers
    assert_same(out, torch.ops.ple.disk_gather(static_ids.cpu(), table.handle, torch.bfloat16))


def test_gathers_late_in_a_graph_after_a_pause(table, monkeypatch):
    """Two gathers behind about 5 ms of other work each, replayed after a
    pause: each one's wake-up node runs beside its ids' copy, 5 ms into the
    replay, and answers its ring without handing it to the thread."""
    monkeypatch.delenv("PLE_GRAPH_GATHER", raising=False)
    first, second = random_ids((16,), 0).cuda(), random_ids((64,), 1).cuda()
    torch.ops.ple.disk_gather(first, table.handle, torch.bfloat16)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.cuda._sleep(10_000_000)  # cycles: about 5 ms at 2 GHz
        out_first = torch.ops.ple.disk_gather(first, table.handle, torch.bfloat16)
        torch.cuda._sleep(10_000_000)
        out_second = torch.ops.ple.disk_gather(second, table.handle, torch.bfloat16)
    before = native.doorbell_counts()
    for seed in range(2, 5):
        time.sleep(0.3)
        ids = random_ids((16,), seed), random_ids((64,), seed + 100)
        first.copy_(ids[0])
        second.copy_(ids[1])
        graph.replay()
        assert_same(out_first, torch.ops.ple.disk_gather(ids[0], table.handle, torch.bfloat16))
        assert_same(out_second, torch.ops.ple.disk_gather(ids[1], table.handle, torch.bfloat16))
    answers = answers_since(before)
    assert answers["by_node"] + answers["by_thread"] == 6, answers
    assert answers["handed_over"] == 0, answers


def test_a_thread_that_always_spins_answers_after_pauses(table, monkeypatch):
    monkeypatch.delenv("PLE_GRAPH_GATHER", raising=False)
    static_ids = random_ids((16,), 0).cuda()
    graph, out = capture_gather(table, static_ids)
    native.set_doorbell_always_spins(True)
    try:
        before = native.doorbell_counts()
        for seed in range(1, 4):
            time.sleep(0.05)
            ids = random_ids((16,), seed)
            static_ids.copy_(ids)
            graph.replay()
            assert_same(out, torch.ops.ple.disk_gather(ids, table.handle, torch.bfloat16))
        assert answers_since(before)["by_thread"] == 3
    finally:
        native.set_doorbell_always_spins(False)


def run_script(body: str, path, timeout: int = 180) -> subprocess.CompletedProcess:
    """Runs `body` (path in PATH) in a fresh interpreter; a hang is a failure."""
    script = textwrap.dedent("""
        import os, sys
        import numpy as np, torch
        import ple
        PATH = sys.argv[1]
        def capture(table, static_ids):
            torch.ops.ple.disk_gather(static_ids, table.handle, torch.bfloat16)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = torch.ops.ple.disk_gather(static_ids, table.handle, torch.bfloat16)
            return graph, out
    """) + textwrap.dedent(body)
    env = {k: v for k, v in os.environ.items() if k != "PLE_GRAPH_GATHER"}
    try:
        return subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True,
                              text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as hang:
        pytest.fail(f"the script hung: {hang.stdout}\n{hang.stderr}")


def test_a_failed_gather_gives_nan_and_the_next_call_raises(table_path):
    proc = run_script("""
        table = ple.Table.from_safetensors(PATH)
        static_ids = torch.tensor([1, 2], device="cuda")
        graph, out = capture(table, static_ids)
        static_ids[1] = 5000
        graph.replay()
        torch.cuda.synchronize()
        assert out.isnan().all(), out
        try:
            torch.ops.ple.disk_gather(static_ids[:1], table.handle)
        except RuntimeError as error:
            assert "row id 5000 at position 1 is out of range" in str(error), error
        else:
            raise AssertionError("the next call did not raise")
        static_ids[1] = 3
        graph.replay()  # the doorbell is answered again after a failure
        torch.cuda.synchronize()
        assert not out.isnan().any()
        print("ok")
    """, table_path)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


def test_a_forked_child_and_the_process_exit_cleanly(table_path):
    # sys.exit in the child runs the native part's static destructors, which
    # must not wait for the parent's doorbell thread.
    proc = run_script("""
        table = ple.Table.from_safetensors(PATH)
        static_ids = torch.tensor([1, 2], device="cuda")
        graph, out = capture(table, static_ids)
        graph.replay()
        torch.cuda.synchronize()
        pid = os.fork()
        if pid == 0:
            sys.exit(7)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 7, status
        graph.replay()
        torch.cuda.synchronize()
        print("ok")
    """, table_path)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


def test_the_exit_with_the_doorbell_thread_asleep(table_path):
    proc = run_script("""
        import time
        table = ple.Table.from_safetensors(PATH)
        static_ids = torch.tensor([1, 2], device="cuda")
        graph, out = capture(table, static_ids)
        graph.replay()
        torch.cuda.synchronize()
        time.sleep(0.5)  # the thread sleeps
        print("ok")
        sys.exit(0)
    """, table_path, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


def test_the_exit_while_a_replay_waits_for_its_ring(table_path):
    # The replay rings 50 ms after the process starts to exit: the doorbell
    # thread, never joined, or the wake-up node answers it.
    proc = run_script("""
        table = ple.Table.from_safetensors(PATH)
        static_ids = torch.tensor([1, 2], device="cuda")
        torch.ops.ple.disk_gather(static_ids, table.handle, torch.bfloat16)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            torch.cuda._sleep(100_000_000)  # about 50 ms
            out = torch.ops.ple.disk_gather(static_ids, table.handle, torch.bfloat16)
        graph.replay()
        print("ok")
        sys.exit(0)
    """, table_path, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


def test_a_close_while_a_replay_waits_for_its_ring(table_path):
    # close() waits for every stream of the device, so the replay (launched
    # on another stream than the capture's) is answered from the open table
    # before its buffers are freed.
    proc = run_script("""
        table = ple.Table.from_safetensors(PATH)
        static_ids = torch.tensor([1, 2], device="cuda")
        want = torch.ops.ple.disk_gather(static_ids, table.handle, torch.bfloat16)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            torch.cuda._sleep(100_000_000)  # about 50 ms
            out = torch.ops.ple.disk_gather(static_ids, table.handle, torch.bfloat16)
        graph.replay()
        table.close()
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), want.view(torch.int16)), (out, want)
        print("ok")
    """, table_path, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr
