"""Builds ple and its CPU-only native part against the torch already installed:

    pip install --no-build-isolation .
"""

import os
import sys
import time

import setuptools
from setuptools import setup

# pyproject.toml gives its license as an SPDX expression, which setuptools reads
# from 77 on; an older one stops at that field with an error that names no fix.
# Python 3.11's venv brings setuptools 65, and torch before 2.13 none newer.
OLDEST_SETUPTOOLS = 77
if int(setuptools.__version__.split(".")[0]) < OLDEST_SETUPTOOLS:
    sys.exit(f"ple builds with setuptools {OLDEST_SETUPTOOLS} or newer, and this environment has "
             f"{setuptools.__version__}: run `pip install 'setuptools>={OLDEST_SETUPTOOLS}'`, then "
             "install ple again")

sys.path.insert(0, "kernels")
# ple is not installed yet: build_flags is read as a plain module.
from build_flags import LIBRARIES, compile_args, module_name, sources, unsupported  # noqa: E402

try:
    import torch
except ImportError:
    sys.exit("ple is built against the torch already installed, and this environment has none "
             "(a plain `pip install .` builds in an isolated one): install torch first, then "
             "`pip install --no-build-isolation .`")
if unsupported(torch.__version__):
    sys.exit(unsupported(torch.__version__))

from torch.utils.cpp_extension import BuildExtension, CppExtension  # noqa: E402

# kernels/native.py compiles the same files when the built module does not fit.
SOURCES = sources("kernels")


class BuildNative(BuildExtension.with_options(use_ninja=True)):
    """torch's extension builder, saying what it builds and how long it took
    (pip shows a build's output with -v only)."""

    def build_extensions(self):
        jobs = os.environ.get("MAX_JOBS") or os.cpu_count()
        print(f"ple: building the native gather for torch {torch.__version__} "
              f"({len(SOURCES)} C++ files, {jobs} parallel jobs; about a minute on 2 cores)",
              file=sys.stderr, flush=True)
        start = time.monotonic()
        super().build_extensions()
        print(f"ple: native gather built in {time.monotonic() - start:.0f} s",
              file=sys.stderr, flush=True)


setup(
    packages=["ple", "ple.integrations", "ple.integrations.vllm", "ple.kernels", "ple.ops",
              "ple.layers", "ple_tools"],
    package_dir={"ple": "ple", "ple.kernels": "kernels", "ple.ops": "ops", "ple.layers": "layers",
                 "ple_tools": "tools"},
    # The sources travel with the package: ple compiles them at import when
    # the built module does not match the running torch.
    package_data={"ple.kernels": ["*.cpp", "*.h"], "ple_tools": ["*.cpp"]},
    ext_modules=[
        CppExtension(
            f"ple.kernels.{module_name(torch.__version__)}",
            SOURCES,
            extra_compile_args=compile_args(torch.__version__),
            libraries=list(LIBRARIES),
        )
    ],
    cmdclass={"build_ext": BuildNative},
)
