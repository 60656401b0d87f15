"""tools/thread_profile.py: a thread's CPU between two samples goes to the
phase at their midpoint, by thread name (the child's main thread apart);
samples with more runnable threads than CPUs are counted per phase; a real
child's threads are read by name, ple's own named so."""

import subprocess
import sys
import time

from ple_tools.thread_profile import OUTSIDE, TICK_S, ThreadSampler, attribute, phase_at


def test_the_phase_of_a_moment():
    phases = [(1.0, 2.0, "reads"), (2.0, 3.0, "compute"), (5.0, 6.0, "reads")]
    assert [phase_at(phases, t) for t in (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 5.5, 7.0)] == [
        OUTSIDE, "reads", "reads", "compute", OUTSIDE, OUTSIDE, "reads", OUTSIDE]


def test_cpu_goes_to_the_phase_between_two_samples():
    sampler = ThreadSampler()
    sampler.cpus = 2
    sampler.names = {10: "main", 11: "ple-gather", 12: "ple-gather", 13: "ple-prefetch"}
    sampler.samples = [
        (0.0, {10: ("R", 0), 11: ("S", 0), 12: ("S", 0)}),
        (1.0, {10: ("R", 10), 11: ("R", 5), 12: ("R", 5), 13: ("R", 1)}),  # a new thread
        (2.0, {10: ("R", 30), 11: ("S", 5), 12: ("S", 6), 13: ("S", 4)}),
    ]
    profile = attribute(sampler, [(0.0, 1.0, "reads"), (1.0, 2.0, "compute")])
    groups = profile["groups"]
    assert list(groups) == ["main", "ple-gather", "ple-prefetch"]  # by CPU, most first
    assert groups["main"]["cpu_s"] == {"reads": 10 * TICK_S, "compute": 20 * TICK_S}
    assert groups["ple-gather"]["threads"] == 2
    assert groups["ple-gather"]["cpu_s"] == {"reads": 10 * TICK_S, "compute": 1 * TICK_S}
    # A thread first seen in a sample has no CPU before it.
    assert groups["ple-prefetch"]["cpu_s"] == {"reads": 0.0, "compute": 3 * TICK_S}
    assert profile["samples"] == {"reads": 1, "compute": 1}
    assert profile["crowded_samples"] == {"reads": 1, "compute": 0}  # 4 runnable on 2 CPUs
    assert profile["mean_runnable"] == {"reads": 4.0, "compute": 1.0}


def test_a_childs_threads_by_name():
    child = subprocess.Popen([sys.executable, "-c", """
import ctypes, threading, time
def busy():
    ctypes.CDLL(None).prctl(15, b"ple-test-busy")
    end = time.thread_time() + 0.3
    while time.thread_time() < end:
        pass
thread = threading.Thread(target=busy)
thread.start()
thread.join()
time.sleep(0.2)
"""])
    sampler = ThreadSampler()
    sampler.start(child.pid)
    child.wait(timeout=60)
    time.sleep(0.05)
    sampler.stop()
    profile = attribute(sampler, [])
    assert len(sampler.samples) >= 10
    busy = profile["groups"]["ple-test-busy"]
    assert busy["threads"] == 1 and busy["cpu_s"][OUTSIDE] >= 0.1
    assert "main" in profile["groups"]
