"""Busy processes that keep CPUs loaded while a benchmark runs, standing in
for what shares a serving machine's CPUs with the gather (a tokenizer, a
scheduler, Python): each is a Python loop that never sleeps, at the normal
priority."""

from __future__ import annotations

import subprocess
import sys

SPIN = "while True:\n    pass\n"


class BusyProcesses:
    """``count`` spinning processes from ``__enter__`` to ``__exit__`` (none for 0)."""

    def __init__(self, count: int):
        self.count = count
        self.processes: list[subprocess.Popen] = []

    def __enter__(self) -> "BusyProcesses":
        self.processes = [subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.DEVNULL)
                          for _ in range(self.count)]
        return self

    def __exit__(self, *exc) -> None:
        for process in self.processes:
            process.kill()
        for process in self.processes:
            process.wait()
        self.processes = []
