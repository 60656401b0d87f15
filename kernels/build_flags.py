"""How the native part is compiled, for setup.py and for the import-time
build in native.py alike (setup.py reads this file before ple is installed,
so it imports nothing of ple)."""

from __future__ import annotations

import re
from pathlib import Path

# cuda_driver.cpp finds the CUDA driver with dlopen at run time.
LIBRARIES = ("dl",)

# The oldest torch release ple supports, the oldest its CI tests
# (pyproject.toml's dependency says the same; a test holds the two together).
OLDEST_TORCH = (2, 9)


def torch_release(torch_version: str) -> tuple[int, int]:
    """``torch_version``'s major and minor release: ``2.13.0+cpu`` -> (2, 13)."""
    match = re.match(r"(\d+)\.(\d+)", torch_version)
    if match is None:
        raise ValueError(f"not a torch version: {torch_version!r}")
    return int(match.group(1)), int(match.group(2))


def unsupported(torch_version: str) -> str | None:
    """Why ple does not support ``torch_version``, or None where it does."""
    if torch_release(torch_version) >= OLDEST_TORCH:
        return None
    oldest = ".".join(map(str, OLDEST_TORCH))
    return (f"ple supports torch {oldest} and newer, and this environment has torch "
            f"{torch_version}: install a newer one (pip install 'torch>={oldest}')")


def sources(directory) -> list[str]:
    """The native part's C++ files in ``directory`` (paths as given, sorted)."""
    return sorted(str(path) for path in Path(directory).glob("*.cpp"))


def torch_tag(torch_version: str) -> str:
    """``torch_version`` as a name part: ``2.13.0+cpu`` -> ``2_13_0_cpu``."""
    return re.sub(r"\W", "_", torch_version)


def module_name(torch_version: str) -> str:
    """The name setup.py gives the module it builds against ``torch_version``
    (in ``ple.kernels``).  One name for each torch: venvs of several torches
    over one checkout (editable installs build into ``kernels/``) each keep
    their own module, and none loads a module built for another torch."""
    return f"_C_{torch_tag(torch_version)}"


def compile_args(torch_version: str) -> list[str]:
    """Flags for a build against ``torch_version``, which the module records
    so that a later import can tell whether it fits the running torch.

    No ``-std=``: torch's extension builder (``BuildExtension`` and
    ``cpp_extension.load`` alike) adds the language standard that its own
    headers need (C++17 with torch 2.9, C++20 with 2.13 and newer; the
    headers of 2.14 and newer refuse anything older than C++20), and a flag
    of ours would come after it on the command line and win.  The sources
    build as C++17 and as C++20."""
    return ["-O3", f"-DPLE_TORCH_VERSION={torch_version}"]
