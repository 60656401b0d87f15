"""Where a benchmark child's CPU goes, thread by thread, cheaply: another
process samples /proc/PID/task/*/stat of the child every ~10 ms (each
thread's name, state and CPU time: utime and stime, in clock ticks) and
attributes each thread's CPU between two samples to what the child was
doing then (its *phases*: intervals it reports, such as a chunk's reads and
its compute).  The child pays nothing: no signal, no thread of its own, no
stack walk (a sampling profiler that walks native stacks, py-spy --native,
slowed an arm past its deadline).

Threads are grouped by name (ple names its own: ple-gather, ple-prefetch,
ple-io, ple-doorbell; CUDA's and torch's keep theirs; the child's main
thread is "main").  Per group: its threads, its CPU seconds in each phase,
and per phase the samples in which more of the child's threads were
runnable (state R) than the CPUs the child may use (its affinity): the
moments when a thread that had work waited for a CPU.

A thread's CPU is counted in clock ticks (10 ms on Linux), so a figure is
good to a tick per thread and interval; summed over a run's hundreds of
samples, to a fraction of that."""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
INTERVAL_S = 0.01
OUTSIDE = "outside"  # the child's time in no phase (its start, its model's build, its end)


class ThreadSampler:
    """Samples one process's threads on a thread of this process, from
    start(pid) to stop().  ``samples``: (time.monotonic(), {tid: (state,
    ticks)}); ``names``: each thread's name (the child's main thread is
    "main")."""

    def __init__(self, interval_s: float = INTERVAL_S):
        self.interval_s = interval_s
        self.samples: list[tuple[float, dict[int, tuple[str, int]]]] = []
        self.names: dict[int, str] = {}
        self.cpus = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, pid: int) -> None:
        try:
            self.cpus = len(os.sched_getaffinity(pid))
        except OSError:
            self.cpus = os.cpu_count() or 1
        self._thread = threading.Thread(target=self._run, args=(pid,), name="thread-sampler",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self, pid: int) -> None:
        tasks = f"/proc/{pid}/task"
        files: dict[int, int] = {}  # tid -> an open stat file, read again from its start
        try:
            next_listing = 0.0
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_listing:  # threads come and go: the list every 100 ms
                    next_listing = now + 10 * self.interval_s
                    try:
                        listed = {int(tid) for tid in os.listdir(tasks)}
                    except OSError:
                        return  # the child has ended
                    for tid in listed - files.keys():
                        try:
                            files[tid] = os.open(f"{tasks}/{tid}/stat", os.O_RDONLY)
                        except OSError:
                            continue
                sample = {}
                for tid, fd in list(files.items()):
                    try:
                        stat = os.pread(fd, 1024, 0).decode()
                    except OSError:  # the thread has ended
                        os.close(files.pop(tid))
                        continue
                    if not stat:
                        os.close(files.pop(tid))
                        continue
                    # pid (comm) state ...: comm may hold spaces and parentheses
                    close = stat.rindex(")")
                    fields = stat[close + 2:].split()
                    # The latest name: a thread may name itself after it starts.
                    self.names[tid] = "main" if tid == pid else stat[stat.index("(") + 1:close]
                    sample[tid] = (fields[0], int(fields[11]) + int(fields[12]))  # utime + stime
                self.samples.append((time.monotonic(), sample))
                self._stop.wait(self.interval_s)
        finally:
            for fd in files.values():
                os.close(fd)


def phase_at(phases: list[tuple[float, float, str]], t: float) -> str:
    """The phase whose interval [start, end) holds ``t`` (``phases`` sorted
    by start, not overlapping), else OUTSIDE."""
    low, high = 0, len(phases)
    while low < high:
        middle = (low + high) // 2
        if phases[middle][0] <= t:
            low = middle + 1
        else:
            high = middle
    if low and phases[low - 1][0] <= t < phases[low - 1][1]:
        return phases[low - 1][2]
    return OUTSIDE


def attribute(sampler: ThreadSampler, phases: list[tuple[float, float, str]]) -> dict:
    """Each thread group's CPU seconds per phase (the CPU between two samples
    goes to the phase at their midpoint), and per phase the samples taken and
    those with more runnable threads than CPUs."""
    phases = sorted(phases)
    cpu: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    members: dict[str, set[int]] = defaultdict(set)
    samples: dict[str, int] = defaultdict(int)
    crowded: dict[str, int] = defaultdict(int)
    runnable: dict[str, int] = defaultdict(int)
    for (t0, before), (t1, after) in zip(sampler.samples, sampler.samples[1:]):
        phase = phase_at(phases, (t0 + t1) / 2)
        for tid, (_, ticks) in after.items():
            group = sampler.names[tid]
            members[group].add(tid)
            spent = ticks - before[tid][1] if tid in before else 0
            cpu[group][phase] += spent * TICK_S
        running = sum(state == "R" for state, _ in after.values())
        samples[phase] += 1
        runnable[phase] += running
        crowded[phase] += running > sampler.cpus
    return {"interval_s": sampler.interval_s, "cpus": sampler.cpus,
            "samples": dict(samples), "crowded_samples": dict(crowded),
            "mean_runnable": {p: runnable[p] / samples[p] for p in samples},
            "groups": {group: {"threads": len(members[group]), "cpu_s": dict(cpu[group])}
                       for group in sorted(members, key=lambda g: -sum(cpu[g].values()))}}


def profile_lines(profile: dict, phase_names: list[str]) -> list[str]:
    """The profile as a table: a row a thread group, a column a phase."""
    columns = [*phase_names, OUTSIDE]
    lines = [f"  threads, CPU s by phase (sampled every {profile['interval_s'] * 1e3:.0f} ms; "
             f"the child may use {profile['cpus']} CPUs):",
             f"    {'thread':<18} {'count':>5} " + " ".join(f"{c:>12}" for c in columns)]
    for group, row in profile["groups"].items():
        lines.append(f"    {group:<18} {row['threads']:>5} "
                     + " ".join(f"{row['cpu_s'].get(c, 0.0):>12.2f}" for c in columns))
    for phase in columns:
        taken = profile["samples"].get(phase, 0)
        if taken:
            crowded = profile["crowded_samples"].get(phase, 0)
            lines.append(f"    {phase}: {taken} samples, {profile['mean_runnable'][phase]:.1f} "
                         f"threads runnable on average, more than the CPUs in {crowded} "
                         f"({crowded / taken:.0%})")
    return lines
