"""What several test modules need: GGUF files written with gguf's writer,
Triton kernel modules loaded under the interpreter, and kernels compiled for
old GPUs in a subprocess."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import gguf
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


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


# Integer views of float tensors, by element size: comparisons to the bit.
INT_VIEW = {4: torch.int32, 2: torch.int16}
# The targets the Triton kernels must compile for (V100, Turing, A100, H100),
# and the output dtypes by their Triton signature names.
COMPILE_CCS = (70, 75, 80, 90)
OUT_SIGNATURE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def dtype_id(d: torch.dtype | None) -> str:
    """A test id for a dtype (None: the table's default)."""
    return "default" if d is None else str(d).removeprefix("torch.")


def compile_for_targets(script: str, names, cache_dir: Path) -> dict:
    """compile_in_subprocess of every (target, format name, output dtype)."""
    return compile_in_subprocess(script, [COMPILE_CCS, list(names), list(OUT_SIGNATURE.values())],
                                 cache_dir)


def compile_in_subprocess(script: str, args: list, cache_dir: Path) -> dict:
    """Runs ``script`` (which compiles kernels with ``triton.compile`` and
    prints a JSON object as its last line) with ``args`` as JSON arguments,
    in a subprocess: the kernel module must be imported there without
    TRITON_INTERPRET, and a fresh cache makes it really compile."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    proc = subprocess.run([sys.executable, "-c", script, *(json.dumps(a) for a in args)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_runs_on_old_gpus(result: dict, cc: int) -> None:
    """A kernel compiled for sm_``cc``: PTX for that target and an ELF cubin,
    with no fp8 conversion (SM89+), no bf16 one (the kernels round to bf16
    with integer operations, the same on every target) and no flush to zero
    (subnormals must survive).  Skips a target the installed ptxas does not
    know: CUDA 13's ptxas (torch's cu13 wheels) has no sm_70."""
    unknown = re.search(rf"Value 'sm_{cc}a?' is not defined for option 'gpu-name'.*?Repro command: (\S+)",
                        result.get("error", ""), re.DOTALL)
    if unknown:
        pytest.skip(f"{unknown.group(1)} cannot build sm_{cc}")
    assert "error" not in result, result.get("error")
    ptx = result["ptx"]
    assert re.search(rf"^\.target sm_{cc}a?\b", ptx, re.MULTILINE)  # Triton targets sm_90a on SM90
    assert result["cubin_head"] == "7f454c46" and result["cubin_len"] > 0
    assert not re.search(r"\bcvt\.[\w.]*(e4m3|e5m2)", ptx)
    assert not re.search(r"\bcvt\.[\w.]*bf16", ptx)
    assert ".ftz" not in ptx
