"""tools/bench_gpu.py's parts that need no GPU: a thread's CPU time found by
its name (how the tool reads the doorbell thread's), the lines of the
replays after a pause, how many turns a pause row takes, and a pause row's
accounts by graph (stand-in graphs and counts)."""

import ctypes
import threading
import time

import torch

from ple_tools import bench_gpu

PR_SET_NAME = 15


def test_a_named_threads_cpu_time():
    named, stop = threading.Event(), threading.Event()

    def work():
        ctypes.CDLL(None).prctl(PR_SET_NAME, b"ple-test-busy")
        end = time.thread_time() + 0.05
        while time.thread_time() < end:
            pass
        named.set()
        stop.wait()

    thread = threading.Thread(target=work)
    thread.start()
    try:
        named.wait(10)
        assert bench_gpu.thread_cpu_ns("ple-test-busy") >= 50e6
    finally:
        stop.set()
        thread.join()
    assert bench_gpu.thread_cpu_ns("ple-test-busy") is None


def test_the_lines_of_replays_after_a_pause():
    pauses = {"after_0ms": {"doorbell_us": 27.0, "host_func_us": 36.0, "doorbell_spinning_us": 26.0,
                            "tiny_us": 10.0, "doorbell_thread_cpu_ms_per_s": 400.0,
                            "answers": {"by_node": 1, "by_thread": 9, "handed_over": 0,
                                        "thread_wakes": 1}},
              "after_5000ms": {"doorbell_us": 110.0, "host_func_us": 100.0,
                               "doorbell_spinning_us": 40.0, "tiny_us": 18.0,
                               "doorbell_thread_cpu_ms_per_s": None,
                               "answers": {"by_node": 3, "by_thread": 0, "handed_over": 0,
                                           "thread_wakes": 0}}}
    title, header, busy, paused, legend, idle = bench_gpu.pauses_lines(pauses, 0.05)
    assert title.startswith("16 warm rows in a graph, replayed after a pause")
    assert header.split() == ["pause", "doorbell", "host", "node", "ratio", "spinning", "one",
                              "kernel", "thread", "CPU", "ms/s", "by", "node", "by", "thread"]
    assert busy.split() == ["0ms", "27.0", "36.0", "0.75x", "26.0", "10.0", "400.00", "1", "9"]
    assert paused.split() == ["5000ms", "110.0", "100.0", "1.10x", "40.0", "18.0", "-", "3", "0"]
    assert "goal <= 1.2x after each pause" in legend
    assert idle.strip() == "the doorbell thread idle for a second: 0.05 ms/s of CPU (goal <= 1)"


def test_rows_of_long_pauses_take_fewer_turns():
    assert bench_gpu.PAUSES_MS == (0, 20, 500, 5000)
    # 4 graphs by turns: 10 turns of 500 ms pauses take 20 s; of 5 s, 3 take 60 s.
    assert [bench_gpu.pause_turns(p, 4, 50) for p in bench_gpu.PAUSES_MS] == [10, 10, 10, 3]
    assert bench_gpu.pause_turns(0, 4, 10) == 5


def test_a_pause_row_accounts_each_graph_apart(monkeypatch):
    """The doorbell graph's answers and the thread's CPU are its own turns',
    not the spinning graph's; the spinning graph is replayed with the thread
    told to spin, and the thread is told to stop after the row."""
    from ple.kernels.native import native

    counts = {"by_thread": 0, "by_node": 0, "handed_over": 0, "thread_wakes": 0}
    cpu_ns = [0]
    spinning = [False]
    told = []

    class Graph:
        def __init__(self, name):
            self.name = name

        def replay(self):
            # The stand-in thread answers while told to spin, else the node does.
            counts["by_thread" if spinning[0] else "by_node"] += 1
            cpu_ns[0] += 5_000_000_000 if spinning[0] else 1_000

    def set_spins(spin):
        told.append(spin)
        spinning[0] = spin

    monkeypatch.setattr(native, "doorbell_counts", lambda: dict(counts), raising=False)
    monkeypatch.setattr(native, "set_doorbell_always_spins", set_spins, raising=False)
    monkeypatch.setattr(bench_gpu, "thread_cpu_ns", lambda name: cpu_ns[0])
    monkeypatch.setattr(bench_gpu, "PAUSES_MS", (0, 1))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    graphs = {name: Graph(name) for name in ("doorbell", "host_func", "tiny")}
    rows = bench_gpu.pause_rows(graphs, 20)
    assert list(rows) == ["after_0ms", "after_1ms"]
    for row in rows.values():
        assert set(row) >= {"doorbell_us", "doorbell_spinning_us", "host_func_us", "tiny_us",
                            "doorbell_over_host_func", "doorbell_thread_cpu_ms_per_s"}
        assert row["answers"]["by_node"] == 5 and row["answers"]["by_thread"] == 0
        # 1 us of CPU a doorbell turn, 5 s a spinning one: counted with the
        # spinning turns, it would be thousands of times a second of CPU.
        assert row["doorbell_thread_cpu_ms_per_s"] < 1000
    assert told[-1] is False and True in told
