"""tools/bench_gpu.py's parts that need no GPU: a thread's CPU time found by
its name (how the tool reads the doorbell thread's), and the lines of the
replays after a pause."""

import ctypes
import threading
import time

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
    pauses = {"after_0ms": {"doorbell_us": 27.0, "tiny_us": 10.0, "host_func_us": 33.0,
                            "doorbell_thread_cpu_ms_per_s": 400.0},
              "after_500ms": {"doorbell_us": 90.0, "tiny_us": 80.0, "host_func_us": 95.0,
                              "doorbell_thread_cpu_ms_per_s": None}}
    header, busy, paused, legend = bench_gpu.pauses_lines(pauses, 0.05)
    assert header.endswith("pause  doorbell one kernel  ratio host node doorbell thread CPU ms/s")
    assert busy.split() == ["0ms", "27.0", "10.0", "2.70x", "33.0", "400.00"]
    assert paused.split() == ["500ms", "90.0", "80.0", "1.12x", "95.0", "-"]
    assert legend.strip().endswith("the doorbell thread idle for a second: 0.05 ms/s of CPU")
