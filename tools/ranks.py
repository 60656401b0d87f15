"""Runs the ranks of a process group as processes of one machine, each its
own command, all at once, and tells how they ended.  A rank that fails ends
the others at once, as does the timeout: ranks wait for each other in
collectives, so one failure would hang the rest, and a hang is a failure
too.  Standard library only (the tools' ``--help`` imports no torch)."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class RanksRun:
    """How the ranks ended: each one's exit status (negative: killed by that
    signal) and log file, and whether the timeout ended them."""
    returncodes: list[int]
    logs: list[Path]
    timed_out: bool

    @property
    def ok(self) -> bool:
        return not self.timed_out and not any(self.returncodes)

    def describe(self, tail_chars: int = 6000) -> str:
        """Why the run failed, then each rank's exit status and the end of its log."""
        why = "the ranks timed out" if self.timed_out else "a rank failed"
        return f"{why}:\n" + "\n".join(
            f"--- rank {rank} (exit {code}) ---\n{log.read_text(errors='replace')[-tail_chars:]}"
            for rank, (code, log) in enumerate(zip(self.returncodes, self.logs)))


def run_ranks(commands: list[list[str]], timeout_s: float, logs: Path,
              env: dict[str, str] | None = None) -> RanksRun:
    """Runs ``commands[r]`` as rank r, its stdout and stderr to
    ``logs/rank{r}.log``, and waits for all of them (at most ``timeout_s``)."""
    logs.mkdir(parents=True, exist_ok=True)
    paths = [logs / f"rank{rank}.log" for rank in range(len(commands))]
    workers: list[subprocess.Popen] = []
    deadline = time.monotonic() + timeout_s
    timed_out = False
    try:
        for command, path in zip(commands, paths):
            with open(path, "w") as log:
                workers.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                                env=env))
        while any(w.poll() is None for w in workers) and not any(w.poll() for w in workers):
            if time.monotonic() >= deadline:
                timed_out = True
                break
            time.sleep(0.05)
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
            worker.wait()
    return RanksRun([w.returncode for w in workers], paths, timed_out)
