"""The processes a tool spreads its work over: spawned, since a forked copy
of a process that has run torch's threads may hang in them, each with its
share of the CPUs for torch's own threads."""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor


def worker_pool(workers: int) -> ProcessPoolExecutor:
    """``workers`` spawned processes (each pays for importing torch, about
    2 s, once)."""
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_share_cpus, initargs=(workers,))


def _share_cpus(workers: int) -> None:
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
