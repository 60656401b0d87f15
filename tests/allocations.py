"""Records the tensors a piece of code makes: every op's outputs (factory
functions, parameters' tensors, copies, a custom op's results), on its
thread and on the threads it starts (transformers materializes a
checkpoint's tensors on a pool of threads), that hold at least a given
number of bytes on a device other than meta, each with whether its memory is
a mapping of a file (safetensors' tensors: the file's pages, read only when
touched) or memory of its own.  On CUDA, the caching
allocator's history also records every block allocated, by torch's ops or
by native code.  The tests of loading (test_load_allocations.py,
test_vllm_load_allocations.py) use it, in their processes and in vLLM's."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


@dataclass(frozen=True)
class Made:
    """A tensor an op made: its op, shape, dtype, device, the bytes of its
    storage and the file its memory maps (None: memory of its own)."""
    op: str
    shape: tuple[int, ...]
    dtype: str
    device: str
    nbytes: int
    mapped_file: str | None

    @property
    def allocated(self) -> bool:
        return self.mapped_file is None


class TensorRecorder(TorchDispatchMode):
    """While active, records (``made``) each tensor an op returns whose
    storage holds at least ``at_least`` bytes, off the meta device.  A
    dispatch mode is a thread's own: :func:`recording` has the threads
    started meanwhile run inside it too."""

    def __init__(self, at_least: int):
        super().__init__()
        self.at_least = at_least
        self.made: list[Made] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                storage = tensor.untyped_storage()
                if storage.nbytes() >= self.at_least:
                    self.made.append(Made(str(func), tuple(tensor.shape), str(tensor.dtype),
                                          str(tensor.device), storage.nbytes(),
                                          _mapped_file(tensor)))
        return out

    def allocated(self) -> list[Made]:
        """The tensors recorded that hold memory of their own."""
        return [made for made in self.made if made.allocated]


@contextmanager
def recording(at_least: int):
    """Yields a :class:`TensorRecorder` active in this thread and in each
    thread started inside the block, for the whole of its run."""
    recorder = TensorRecorder(at_least)
    run = threading.Thread.run

    def run_recorded(thread):
        with recorder:
            run(thread)

    threading.Thread.run = run_recorded
    try:
        with recorder:
            yield recorder
    finally:
        threading.Thread.run = run


def _mapped_file(tensor: torch.Tensor) -> str | None:
    """The file whose mapping holds ``tensor``'s memory (a CPU tensor), or
    None."""
    if tensor.device.type != "cpu":
        return None
    address = tensor.untyped_storage().data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, stop = (int(end, 16) for end in fields[0].split("-"))
            if start <= address < stop:
                path = fields[5].strip() if len(fields) == 6 else ""
                return path if path.startswith("/") else None
    return None


@contextmanager
def cuda_allocations():
    """Yields a list that, once the block ends, holds the size of every
    block torch's CUDA caching allocator allocated inside it."""
    sizes: list[int] = []
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    try:
        yield sizes
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    sizes.extend(entry["size"] for trace in snapshot["device_traces"] for entry in trace
                 if entry["action"] == "alloc")
