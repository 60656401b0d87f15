"""What several test modules need: GGUF files written with gguf's writer, and
Triton kernel modules loaded under the interpreter."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import gguf


def write_gguf(path, tensors: dict) -> None:
    """A GGUF file of ``{name: (data, GGMLQuantizationType)}``; F32 and F16
    data are numpy arrays of values, other types raw block bytes."""
    writer = gguf.GGUFWriter(str(path), "test")
    for name, (data, qtype) in tensors.items():
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_interpreted(path: Path, stand_ins: dict[str, Path] | None = None) -> ModuleType:
    """The kernel module at ``path``, loaded under a private name with
    TRITON_INTERPRET=1, so that its kernels run on CPU tensors.  The variable
    is read when ``@triton.jit`` decorates a function, so it is set for the
    load only: the operators' own copies of the kernels stay compiled.
    ``stand_ins``: modules it imports kernels from (``{"ple.kernels.x": path}``),
    loaded interpreted too and put in ``sys.modules`` while it loads."""
    old_env = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    replaced = {name: sys.modules.get(name) for name in stand_ins or {}}
    try:
        for name, dependency in (stand_ins or {}).items():
            sys.modules[name] = _load(f"_interpreted_{Path(dependency).stem}_for_{path.stem}", dependency)
        return _load(f"_interpreted_{path.stem}", path)
    finally:
        for name, module in replaced.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        if old_env is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old_env
