"""Launching a Triton kernel again without its JIT's per-call work.

A JIT launch binds the arguments, derives their specialization (each
pointer's dtype and 16-byte alignment, each integer's value class) and
hashes it into a cache key on every call: about 15 us of a 16-row decode's
host time on an H200 host, more than the rest of the launch.  Here the
compiled kernel of the first launch is kept under a key of its own that
determines that specialization (the device, the pointers' dtypes and
alignments, the integers' exact values, the constexprs and options), and a
later launch of the same key calls the compiled kernel directly.

Under the Triton interpreter (the CPU tests) nothing is compiled, and every
launch goes through it.

Only imported where triton is available.
"""

from __future__ import annotations

import torch


class LaunchCache:
    """``launch(grid, args, stream, **meta)`` for one ``@triton.jit`` kernel
    whose constexpr parameters come after all the others (``meta``: those
    constexprs and compile options such as ``enable_fp_fusion``)."""

    def __init__(self, kernel):
        self.kernel = kernel
        self._compiled: dict[tuple, object] = {}
        params = getattr(kernel, "params", None)
        if params is None:  # the interpreter's kernel: nothing is compiled
            self.constexpr_names = None
            return
        self.constexpr_names = [p.name for p in params if p.is_constexpr]
        trailing = [p.name for p in params[len(params) - len(self.constexpr_names):]]
        if trailing != self.constexpr_names:
            raise ValueError(f"{kernel.fn.__name__}: its constexpr parameters must come last")

    def launch(self, grid: tuple[int, int, int], args: tuple, device: int, **meta) -> None:
        """Launches on the current stream of ``device`` (an index, the
        current device), as ``kernel[grid](*args, **meta)`` does."""
        if self.constexpr_names is None:
            self.kernel[grid](*args, **meta)
            return
        key = (device, *map(_specialization, args), *meta.items())
        compiled = self._compiled.get(key)
        if compiled is not None:
            compiled[grid](*args, *(meta[name] for name in self.constexpr_names),
                           stream=torch._C._cuda_getCurrentRawStream(device))
            return
        self._compiled[key] = self.kernel[grid](*args, **meta)


def _specialization(arg) -> object:
    """What of ``arg`` a Triton launch specializes on, or more: a tensor's
    dtype and whether its address is 16-byte aligned, an integer's value, a
    float's type only (a float is always passed as fp32; its value, NaN
    included, would make keys that never match)."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if isinstance(arg, float):
        return float
    return type(arg), arg
