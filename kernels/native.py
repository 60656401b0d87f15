"""Loads the native part: the module built by setup.py when it matches the
running torch, otherwise the same sources compiled with ninja by the first
import that needs them (later imports load what it built)."""

from __future__ import annotations

import atexit
import importlib
import importlib.util
import logging
import os
import shutil
import sys
from pathlib import Path

import torch

from .build_flags import LIBRARIES, compile_args, module_name, sources, torch_tag, unsupported

log = logging.getLogger("ple")

SOURCE_DIR = Path(__file__).resolve().parent


def _prebuilt():
    if os.environ.get("PLE_FORCE_JIT") == "1":
        return None
    try:
        # setup.py names the module after the torch it was built against.
        module = importlib.import_module(f".{module_name(torch.__version__)}", __package__)
    except ImportError as error:
        log.info("ple: no usable prebuilt native module (%s)", error)
        return None
    if module.torch_version != torch.__version__:
        log.info("ple: prebuilt native module is for torch %s, running %s",
                 module.torch_version, torch.__version__)
        return None
    return module


def _built(module: Path) -> bool:
    """Whether ``module``, built by an earlier import, is newer than every
    source it is built from."""
    if not module.exists():
        return False
    built_at = module.stat().st_mtime
    return all(path.stat().st_mtime <= built_at
               for pattern in ("*.cpp", "*.h") for path in SOURCE_DIR.glob(pattern))


def _compile_now():
    tag = torch_tag(torch.__version__)
    # The module is built for one torch and one Python; several Pythons may
    # share a build directory.
    name = f"ple_native_{tag}_{sys.implementation.cache_tag.replace('-', '_')}"
    build_dir = Path(os.environ.get("PLE_BUILD_DIR", Path.home() / ".cache" / "ple" / tag))
    # A copy of what the builder built, renamed into place whole: later
    # imports load it without the builder, which may be building it again
    # meanwhile and says things of its own on import (a CUDA build of torch on
    # a machine without CUDA warns that no CUDA runtime is found).
    ready = build_dir / f"{name}.ready.so"
    if _built(ready):
        spec = importlib.util.spec_from_file_location(name, ready)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    log.warning("ple: compiling the native gather for torch %s in %s (once, about a minute)",
                torch.__version__, build_dir)
    module = cpp_extension.load(
        name=name,
        sources=sources(SOURCE_DIR),
        extra_cflags=compile_args(torch.__version__),
        extra_ldflags=[f"-l{library}" for library in LIBRARIES],
        build_directory=str(build_dir),
        verbose=False,
    )
    copy = ready.with_name(f"{ready.name}.{os.getpid()}")
    shutil.copyfile(module.__file__, copy)
    os.replace(copy, ready)
    return module


if unsupported(torch.__version__):
    log.warning("%s; ple may not build or run here", unsupported(torch.__version__))
native = _prebuilt() or _compile_now()
# Python's exit runs this before it ends daemon threads: ple's terminate
# handler goes back where a library loaded since has replaced it.
atexit.register(native.install_terminate_handler)
