"""Builds ple and its CPU-only native part against the torch already installed:

    pip install --no-build-isolation .
"""

import sys

import torch
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

sys.path.insert(0, "kernels")
from build_flags import LIBRARIES, compile_args, sources  # noqa: E402  (ple is not installed yet)

# kernels/native.py compiles the same files when the built module does not fit.
SOURCES = sources("kernels")

setup(
    packages=["ple", "ple.integrations", "ple.kernels", "ple.ops", "ple.layers"],
    package_dir={"ple": "ple", "ple.kernels": "kernels", "ple.ops": "ops", "ple.layers": "layers"},
    # The sources travel with the package: ple compiles them at import when
    # the built module does not match the running torch.
    package_data={"ple.kernels": ["*.cpp", "*.h"]},
    ext_modules=[
        CppExtension(
            "ple.kernels._C",
            SOURCES,
            extra_compile_args=compile_args(torch.__version__),
            libraries=list(LIBRARIES),
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
