"""Loads the native part: the module built by setup.py when it matches the
running torch, otherwise the same sources compiled now with ninja."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from .build_flags import LIBRARIES, compile_args, sources

log = logging.getLogger("ple")

SOURCE_DIR = Path(__file__).resolve().parent


def _prebuilt():
    if os.environ.get("PLE_FORCE_JIT") == "1":
        return None
    try:
        from . import _C
    except ImportError as error:
        log.info("ple: no usable prebuilt native module (%s)", error)
        return None
    if _C.torch_version != torch.__version__:
        log.info("ple: prebuilt native module is for torch %s, running %s",
                 _C.torch_version, torch.__version__)
        return None
    return _C


def _compile_now():
    from torch.utils import cpp_extension

    tag = torch.__version__.replace("+", "_").replace(".", "_")
    build_dir = Path(os.environ.get("PLE_BUILD_DIR", Path.home() / ".cache" / "ple" / tag))
    build_dir.mkdir(parents=True, exist_ok=True)
    log.warning("ple: compiling the native gather for torch %s in %s (once, about a minute)",
                torch.__version__, build_dir)
    return cpp_extension.load(
        name=f"ple_native_{tag}",
        sources=sources(SOURCE_DIR),
        extra_cflags=compile_args(torch.__version__),
        extra_ldflags=[f"-l{library}" for library in LIBRARIES],
        build_directory=str(build_dir),
        verbose=False,
    )


native = _prebuilt() or _compile_now()
