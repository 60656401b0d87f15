"""One benchmark arm in a child process of its own, bounded in time.

The parent starts ``python -m MODULE --child SPEC`` (SPEC: JSON, with the
path of a file the child appends JSON lines to: progress as it goes, its
result last) and waits at most a deadline: a child under a memory cgroup
with little headroom can be throttled to a crawl, and a benchmark must say
so rather than wait.  A child past its deadline is killed and reported as
timed out, with the lines it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass


@dataclass
class ChildRun:
    lines: list[dict]  # what the child wrote, in order
    seconds: float
    code: int | None  # exit status; None: killed at the deadline
    timed_out: bool


def module_command(module: str, *args: str) -> list[str]:
    """``python -m module args`` with the working directory left off
    sys.path (``-P``, Python 3.11 and later), so that a folder there named
    like a package the child imports cannot hide it."""
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    return [sys.executable, *safe_path, "-m", module, *args]


def run_child(module: str, spec: dict, deadline_s: float, sampler=None) -> ChildRun:
    """Runs ``module``'s child with ``spec`` (plus ``"out"``: the file it
    writes its lines to) for at most ``deadline_s`` seconds; ``sampler``
    (a ple_tools.thread_profile.ThreadSampler) samples its threads from its
    start to its end."""
    fd, out = tempfile.mkstemp(prefix="ple-arm-", suffix=".jsonl")
    os.close(fd)
    try:
        start = time.perf_counter()
        command = module_command(module, "--child", json.dumps({**spec, "out": out}))
        child = subprocess.Popen(command)
        if sampler is not None:
            sampler.start(child.pid)
        try:
            code, timed_out = child.wait(timeout=deadline_s), False
        except subprocess.TimeoutExpired:
            child.kill()  # SIGKILL: a throttled child may not get to handle SIGTERM soon
            child.wait()
            code, timed_out = None, True
        finally:
            if sampler is not None:
                sampler.stop()
        seconds = time.perf_counter() - start
        with open(out) as handle:
            lines = [json.loads(line) for line in handle if line.endswith("\n")]
        return ChildRun(lines, seconds, code, timed_out)
    finally:
        os.unlink(out)


def write_line(spec: dict, record: dict) -> None:
    """In the child: appends one JSON line to the parent's file, flushed, so
    that it survives a kill at the deadline."""
    with open(spec["out"], "a") as handle:
        handle.write(json.dumps(record) + "\n")
