"""Launching a Triton kernel again without its JIT's per-call work.

A JIT launch binds the arguments, derives their specialization (each
pointer's dtype and 16-byte alignment, each integer's value class) and
hashes it into a cache key on every call: about 15 us of a 16-row decode's
host time on an H200 host, more than the rest of the launch.  Here the
compiled kernel of the first launch is kept under a key of its own that
determines that specialization (the device, the pointers' dtypes and
alignments, the integers' exact values, the constexprs and options), and a
later launch of the same key launches that compiled kernel directly.

Building that key still reads every argument (a tensor's dtype and
address, an integer's type: about half a microsecond a tensor).  A caller
that knows what determines its specialization (the decoders: the row
format, the output's dtype and width, the tiers' layout) names it as a
*plan*, with the positions of its tensors: a planned launch whose tensors
are all 16-byte aligned, as an earlier one of the same plan was, reads only
their addresses and launches that launch's compiled kernel.

The compiled kernel is launched with each tensor passed as its address,
read once for the key and the launch (a launcher given a tensor asks it for
its address again: about 5 us of the 8 tensors of a decode), through
torch's static launcher where torch has one for the kernel
(``torch._inductor``'s ``StaticallyLaunchedCudaKernel``, which
``torch.compile`` launches its own Triton kernels with; its C++ launch is
called directly, with the argument types it derived once), else through
Triton's.  (On an H200 host the two took 13.0 and 13.5 us with tensors; the
static one 8.3 us with addresses.)

Under the Triton interpreter (the CPU tests) nothing is compiled, and every
launch goes through it.

Only imported where triton is available.
"""

from __future__ import annotations

import torch


class LaunchCache:
    """``launch(grid, args, device, **meta)`` for one ``@triton.jit`` kernel
    whose constexpr parameters come after all the others (``meta``: those
    constexprs and compile options such as ``enable_fp_fusion``)."""

    def __init__(self, kernel):
        self.kernel = kernel
        self._launchers: dict[tuple, object] = {}
        self._planned: dict = {}  # plan -> the launcher of its aligned calls
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
        self._launch(grid, args, device, meta)

    def launch_planned(self, plan, tensors: tuple[int, ...], grid: tuple[int, int, int],
                       args: tuple, device: int, meta: dict) -> None:
        """``launch(grid, args, device, **meta)`` of a call whose ``plan``
        (hashable) determines all that the launch specializes on but its
        tensors' alignment: the tensors' dtypes, the other arguments' values
        (a float's type only), ``meta`` and ``device``.  ``tensors``: the
        positions of the tensors in ``args``.  A call whose tensors are all
        16-byte aligned launches the compiled kernel of the plan's first
        such call."""
        launcher = self._planned.get(plan)
        if launcher is not None:
            values = list(args)
            addresses = 0
            for i in tensors:
                values[i] = address = args[i].data_ptr()
                addresses |= address
            if not addresses & 15:
                launcher(grid, values, torch._C._cuda_getCurrentRawStream(device))
                return
        launcher = self._launch(grid, args, device, meta)
        if launcher is not None and all(not args[i].data_ptr() & 15 for i in tensors):
            self._planned[plan] = launcher

    def _launch(self, grid: tuple[int, int, int], args: tuple, device: int, meta: dict):
        """``launch``; returns the launcher of the call's key (None under the
        interpreter)."""
        if self.constexpr_names is None:
            self.kernel[grid](*args, **meta)
            return None
        key, values = _key(args, device, meta)
        launcher = self._launchers.get(key)
        if launcher is not None:
            launcher(grid, values, torch._C._cuda_getCurrentRawStream(device))
            return launcher
        compiled = self.kernel[grid](*args, **meta)
        constexprs = tuple(meta[name] for name in self.constexpr_names)
        launcher = self._launchers[key] = (static_launcher(compiled, len(args))
                                           or TritonLaunch(compiled, constexprs))
        return launcher

    def launchers(self) -> list:
        """The launchers made so far, one a specialization."""
        return list(self._launchers.values())


class TritonLaunch:
    """A launch of a compiled kernel through Triton's own launcher."""

    def __init__(self, compiled, constexprs: tuple):
        self.compiled = compiled
        self.constexprs = constexprs

    def __call__(self, grid: tuple[int, int, int], args: tuple, stream: int) -> None:
        self.compiled[grid](*args, *self.constexprs, stream=stream)


class StaticLaunch:
    """A launch of a compiled kernel through torch's static launcher: the
    arguments the kernel takes (``kept``: their positions among a launch's
    arguments, None for all; an integer argument the compiler made a
    constant is not passed).  Where the launcher's parts are those this
    knows (CUDA, not ROCm), its C++ launch is called with what its ``run``
    would pass, the argument types and scratch arguments derived once."""

    def __init__(self, static, kept: tuple[int, ...] | None):
        self.run = static.run
        self.kept = kept
        self._direct = _direct_launch(static)

    def __call__(self, grid: tuple[int, int, int], args, stream: int) -> None:
        if self.kept is not None:
            args = [args[i] for i in self.kept]
        if self._direct is None:
            self.run(*grid, stream, *args)
            return
        launch, function, num_warps, shared, arg_tys, scratch = self._direct
        try:
            launch(function, *grid, num_warps, shared, arg_tys, (*args, *scratch), stream)
        except TypeError:  # a launch this does not know how to call: refused before it ran
            self._direct = None
            self.run(*grid, stream, *args)


def _direct_launch(static) -> tuple | None:
    """``(launch, function, num_warps, shared, arg_tys, scratch)``: what
    ``static.run`` passes to its C++ launch, or None where it may do more
    than this knows (ROCm, another torch's launcher)."""
    if torch.version.hip is not None:
        return None
    try:
        launch = static.C_impl._launch_kernel
        parts = (static.function, static.num_warps, static.shared, static.arg_tys)
    except (AttributeError, ImportError, NotImplementedError):
        return None
    scratch = tuple(None for flag in ("has_global_scratch", "has_profile_scratch")
                    if getattr(static, flag, False))
    function, num_warps, shared, arg_tys = parts
    return launch, function, num_warps, shared, arg_tys + "O" * len(scratch), scratch


def static_launcher(compiled, num_args: int) -> StaticLaunch | None:
    """torch's static launcher of ``compiled`` (launched with ``num_args``
    arguments before its constexprs), or None where torch cannot launch it
    (a CPU build of torch, launch hooks set, scratch memory, several CTAs,
    an argument type it does not know)."""
    if not hasattr(torch._C, "_StaticCudaLauncher") or "cubin" not in getattr(compiled, "asm", {}):
        return None
    try:
        from torch._inductor.runtime.static_triton_launcher import StaticallyLaunchedCudaKernel
    except ImportError:  # torch before 2.13
        try:
            from torch._inductor.runtime.static_cuda_launcher import StaticallyLaunchedCudaKernel
        except ImportError:  # a torch that moved it again: Triton's launcher serves
            return None
    compiled._init_handles()  # loads the kernel: its function handle is launched
    if not hasattr(compiled, "_cubin_path"):
        compiled._cubin_path = None  # read by the constructor; the kernel is never loaded again
    try:
        static = StaticallyLaunchedCudaKernel(compiled)
    except (NotImplementedError, KeyError):
        return None
    static.function = compiled.function
    kept = _passed_args(compiled.src, num_args)
    if len(kept) != len(static.arg_tys):
        return None
    return StaticLaunch(static, None if kept == tuple(range(num_args)) else kept)


def _passed_args(src, num_args: int) -> tuple[int, ...]:
    """The positions, among the first ``num_args`` parameters, of those the
    compiled kernel takes: not constexpr, by declaration or specialization."""
    names = src.fn.arg_names

    def position(key) -> int:  # a name, an index or a path of indices, by Triton's version
        if isinstance(key, str):
            return names.index(key)
        return key[0] if isinstance(key, tuple) else key

    constants = {position(key) for key in getattr(src, "constants", {})}
    types = {position(key): ty for key, ty in src.signature.items()}
    return tuple(i for i in range(num_args) if types.get(i) != "constexpr" and i not in constants)


def _key(args: tuple, device: int, meta: dict) -> tuple[tuple, list]:
    """The key of a launch: the device, what of ``args`` a Triton launch
    specializes on, or more (each tensor's dtype and whether its address is
    16-byte aligned, each integer's value, each float's type only: a float
    is always passed as fp32, and its value, NaN included, would make keys
    that never match), and ``meta``; and the values a compiled launch takes,
    each tensor as its address (read once: a launcher asked for a tensor's
    address asks the tensor)."""
    key, values = [device], []
    for arg in args:
        kind = type(arg)
        if kind is int:
            key.append(arg)
            values.append(arg)
        elif kind is float:
            key.append(float)
            values.append(arg)
        elif isinstance(arg, torch.Tensor):
            address = arg.data_ptr()
            key.append((arg.dtype, address % 16 == 0))
            values.append(address)
        else:
            key.append((kind, arg))
            values.append(arg)
    key.extend(meta.items())
    return tuple(key), values
