"""kernels/launch_cache.py: a launch that specializes as an earlier one calls
the earlier launch's compiled kernel (the constexprs after the other
arguments, on the device's current stream); one that does not (another
alignment, integer, dtype, device or constexpr) goes through the JIT; a
float's value is never part of the key.  A planned launch with its tensors
aligned calls its plan's compiled kernel; one with a tensor misaligned
takes the keyed launch.  torch's static launcher is called through its C++
launch with the types and scratch arguments its run would pass, and through
its run where that launch refuses the call.  A stand-in kernel records the
launches (the GPU tests launch the real decoders this way)."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")
from ple.kernels.launch_cache import (  # noqa: E402
    LaunchCache, StaticLaunch, TritonLaunch, _passed_args)


class Compiled:
    def __init__(self, launches):
        self.launches = launches

    def __getitem__(self, grid):
        return lambda *args, stream: self.launches.append(("compiled", grid, args, stream))


class Kernel:
    """A @triton.jit kernel's face: its params, and a JIT launch that returns
    the compiled kernel."""

    def __init__(self, names, constexprs):
        self.params = [SimpleNamespace(name=n, is_constexpr=n in constexprs) for n in names]
        self.fn = SimpleNamespace(__name__="kernel")
        self.launches = []

    def __getitem__(self, grid):
        def jit(*args, **meta):
            self.launches.append(("jit", grid, args, meta))
            return Compiled(self.launches)
        return jit


@pytest.fixture
def stream(monkeypatch):
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1000 + device,
                        raising=False)


def test_a_launch_like_an_earlier_one_calls_its_compiled_kernel(stream):
    kernel = Kernel(["x", "n", "scale", "BLOCK"], {"BLOCK"})
    cache = LaunchCache(kernel)
    x = torch.zeros(64, dtype=torch.uint8)
    grid = (4, 1, 1)
    cache.launch(grid, (x, 7, 0.5), 0, BLOCK=16, enable_fp_fusion=False)
    cache.launch(grid, (x, 7, float("nan")), 0, BLOCK=16, enable_fp_fusion=False)
    assert [launch[0] for launch in kernel.launches] == ["jit", "compiled"]
    _, got_grid, args, stream_id = kernel.launches[1]
    # The constexprs follow the arguments; the options are the compiled kernel's own.
    assert got_grid == grid and args[1:] == (7, pytest.approx(float("nan"), nan_ok=True), 16)
    assert args[0] == x.data_ptr()  # a tensor goes as its address, read once
    assert stream_id == 1000


@pytest.mark.parametrize("change", ["alignment", "integer", "dtype", "device", "constexpr"])
def test_a_launch_that_specializes_otherwise_goes_through_the_jit(stream, change):
    kernel = Kernel(["x", "n", "BLOCK"], {"BLOCK"})
    cache = LaunchCache(kernel)
    x = torch.zeros(64, dtype=torch.uint8)
    cache.launch((1, 1, 1), (x, 16), 0, BLOCK=16)
    other = {"alignment": ((x[8:], 16), 0, 16), "integer": ((x, 1), 0, 16),
             "dtype": ((x.view(torch.int8), 16), 0, 16), "device": ((x, 16), 1, 16),
             "constexpr": ((x, 16), 0, 32)}[change]
    args, device, block = other
    cache.launch((1, 1, 1), args, device, BLOCK=block)
    assert [launch[0] for launch in kernel.launches] == ["jit", "jit"]
    cache.launch((1, 1, 1), args, device, BLOCK=block)
    assert kernel.launches[-1][0] == "compiled"


def test_constexprs_must_come_last():
    with pytest.raises(ValueError, match="constexpr parameters must come last"):
        LaunchCache(Kernel(["BLOCK", "x"], {"BLOCK"}))


def test_without_torchs_static_launcher_the_compiled_kernel_launches_through_triton(stream):
    # This torch (a CPU build in CI) has no static launcher, or the stand-in
    # is no kernel it can launch: the launch goes through Triton's.
    kernel = Kernel(["x", "BLOCK"], {"BLOCK"})
    cache = LaunchCache(kernel)
    x = torch.zeros(64, dtype=torch.uint8)
    cache.launch((1, 1, 1), (x,), 0, BLOCK=16)
    assert [type(launcher) for launcher in cache.launchers()] == [TritonLaunch]


def test_a_static_launch_passes_only_the_arguments_the_compiled_kernel_takes():
    runs = []
    static = SimpleNamespace(run=lambda *args: runs.append(args))
    # "n" was 1 at compile time: the compiler made it a constant.
    src = SimpleNamespace(fn=SimpleNamespace(arg_names=["x", "n", "scale", "BLOCK"]),
                          signature={"x": "*u8", "n": "constexpr", "scale": "fp32",
                                     "BLOCK": "constexpr"}, constants={(1,): 1, (3,): 16})
    kept = _passed_args(src, 3)
    assert kept == (0, 2)
    StaticLaunch(static, kept)((4, 2, 1), [1234, 1, 0.5], 99)
    assert runs == [(4, 2, 1, 99, 1234, 0.5)]


def test_a_planned_launch_calls_its_plans_compiled_kernel(stream):
    kernel = Kernel(["x", "y", "n", "scale", "BLOCK"], {"BLOCK"})
    cache = LaunchCache(kernel)
    x, y = torch.zeros(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    grid = (2, 1, 1)
    for first in (x, y):
        cache.launch_planned("plan", (0, 1), grid, (first, y, 5, 0.5), 0, {"BLOCK": 16})
    assert [launch[0] for launch in kernel.launches] == ["jit", "compiled"]
    assert kernel.launches[1][2] == (y.data_ptr(), y.data_ptr(), 5, 0.5, 16)
    # A misaligned tensor takes the keyed launch, which compiles its own.
    cache.launch_planned("plan", (0, 1), grid, (x[8:], y, 5, 0.5), 0, {"BLOCK": 16})
    assert kernel.launches[-1][0] == "jit"
    cache.launch_planned("plan", (0, 1), grid, (x, y, 5, 0.5), 0, {"BLOCK": 16})
    assert kernel.launches[-1][0] == "compiled"
    # Another plan (here: another integer) is keyed anew.
    cache.launch_planned("other", (0, 1), grid, (x, y, 6, 0.5), 0, {"BLOCK": 16})
    assert kernel.launches[-1][0] == "jit"


def test_a_plan_whose_first_launch_was_misaligned_is_not_kept(stream):
    kernel = Kernel(["x", "BLOCK"], {"BLOCK"})
    cache = LaunchCache(kernel)
    x = torch.zeros(64, dtype=torch.uint8)
    cache.launch_planned("plan", (0,), (1, 1, 1), (x[8:],), 0, {"BLOCK": 16})
    cache.launch_planned("plan", (0,), (1, 1, 1), (x,), 0, {"BLOCK": 16})
    assert [launch[0] for launch in kernel.launches] == ["jit", "jit"]


class CppLaunch:
    def __init__(self, refuse: bool = False):
        self.calls, self.refuse = [], refuse

    def _launch_kernel(self, *args):
        if self.refuse:
            raise TypeError("incompatible function arguments")
        self.calls.append(args)


def test_a_static_launch_calls_torchs_cpp_launch_as_its_run_would():
    runs, cpp = [], CppLaunch()
    static = SimpleNamespace(run=lambda *args: runs.append(args), C_impl=cpp, function=77,
                             num_warps=4, shared=0, arg_tys="KiO", has_global_scratch=True,
                             has_profile_scratch=False)
    StaticLaunch(static, None)((4, 2, 1), [1234, 3, 0.5], 99)
    assert runs == [] and cpp.calls == [(77, 4, 2, 1, 4, 0, "KiOO", (1234, 3, 0.5, None), 99)]


def test_a_static_launch_that_its_cpp_launch_refuses_goes_through_run():
    runs, cpp = [], CppLaunch(refuse=True)
    static = SimpleNamespace(run=lambda *args: runs.append(args), C_impl=cpp, function=77,
                             num_warps=4, shared=0, arg_tys="K")
    launch = StaticLaunch(static, None)
    launch((1, 1, 1), [1234], 99)
    launch((1, 1, 1), [1234], 99)
    assert runs == [(1, 1, 1, 99, 1234)] * 2 and cpp.calls == []
