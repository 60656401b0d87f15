"""Builds ple and its CPU-only native part against the torch already installed:

    pip install --no-build-isolation .
"""

import sys

from setuptools import setup

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

setup(
    packages=["ple", "ple.integrations", "ple.kernels", "ple.ops", "ple.layers"],
    package_dir={"ple": "ple", "ple.kernels": "kernels", "ple.ops": "ops", "ple.layers": "layers"},
    # The sources travel with the package: ple compiles them at import when
    # the built module does not match the running torch.
    package_data={"ple.kernels": ["*.cpp", "*.h"]},
    ext_modules=[
        CppExtension(
            f"ple.kernels.{module_name(torch.__version__)}",
            SOURCES,
            extra_compile_args=compile_args(torch.__version__),
            libraries=list(LIBRARIES),
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
