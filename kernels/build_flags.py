"""How the native part is compiled, for setup.py and for the import-time
build in native.py alike (setup.py reads this file before ple is installed,
so it imports nothing of ple)."""

from pathlib import Path

# host_gather.cpp finds the CUDA driver with dlopen at run time.
LIBRARIES = ("dl",)


def sources(directory) -> list[str]:
    """The native part's C++ files in ``directory`` (paths as given, sorted)."""
    return sorted(str(path) for path in Path(directory).glob("*.cpp"))


def compile_args(torch_version: str) -> list[str]:
    """Flags for a build against ``torch_version``, which the module records
    so that a later import can tell whether it fits the running torch."""
    return ["-O3", "-std=c++17", f"-DPLE_TORCH_VERSION={torch_version}"]
