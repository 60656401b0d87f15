"""``torch.ops.ple.disk_gather`` and ``torch.ops.ple.disk_gather_bytes``.

Both take ids of any shape and a table handle (``ple.Table.handle``: a str
that names the table and its files' identity, so that a graph or program
holding it reaches that table in any process, or raises) and return new
tensors ``[*ids.shape, ...]``; the CPU kernels run the native windowed gather, ``disk_gather`` then decodes the rows.  ``disk_gather`` also
has a CUDA kernel (disk_gather_cuda.py); ``disk_gather_bytes`` is CPU only.

``round_scale`` chooses the arithmetic of scaled rows (fp8_e4m3fn, u8, i8):
False (the default) gives ``(values.to(float32) * scale).to(dtype)``, one
float32 product rounded to ``dtype``; True gives ``values.to(dtype) *
scale.to(dtype)``, the scale rounded to ``dtype`` first, which is what a
model holding the scale in its own dtype computes (transformers'
``FP8Embedding``, vLLM's Qwen4Exp; ``ple.formats.applied_scale``).  They
differ only where the scale is not a value of ``dtype`` (never in float32).
The default is the float32 product because it is the closer to value x
scale (a scale rounded to bfloat16 is off by up to 2**-9 of itself, and
every value carries that error), and because with it the rows in any dtype are
the float32 rows cast; the layers that stand in for a model's module pass
that module's choice.

``scale`` (default: the table's) is the value the scaled rows' values are
multiplied by, rounded as ``round_scale`` says: a module that holds its scale
as a tensor of its own (``ple.layers.DiskEmbedding``), cast with the module
as a model casts its ``weight_scale``, passes that tensor's value.

``owner`` (default 0: none) is the prefetch owner the gather is made for
(``Table.prefetch``'s): a layer passes its own, so that when the owner has a
lookahead plan (``Table.plan_prefetches``) the gather advances or ends it
as it runs, on the host, in a CUDA stream or on a captured graph's replays
(``ple.layers.lookahead``).  It changes no row.
"""

from __future__ import annotations

import functools
import sys
import weakref

import torch

from ple.formats import OUTPUT_DTYPES, applied_scale
from ple.kernels.decode import decode_rows
from ple.kernels.native import native
from ple.table import Table, check_dense_ids, table_for_handle

_lib = torch.library.Library("ple", "DEF")
_lib.define("disk_gather_bytes(Tensor ids, str table) -> Tensor")
_lib.define("disk_gather(Tensor ids, str table, ScalarType? dtype=None, bool round_scale=False"
            ", float? scale=None, int owner=0) -> Tensor")

# What a gather says once Python has begun to finalize: by then the operators
# may be gone with the modules that define them.
EXITING = ("ple: the process is exiting (Python is finalizing its modules): no gather runs now; "
           "gather before the interpreter exits (an atexit handler still may)")


def _keep_registered_while_python_runs(library: torch.library.Library) -> None:
    """torch undoes a Library's registrations when it is collected and, through
    the weakref.finalize that does it, in an atexit hook, while daemon threads
    still run: a gather of theirs would then fail inside torch ("'_OpNamespace'
    'ple' object has no attribute 'disk_gather'", an INTERNAL ASSERT, or a
    crash).  ple's operators stay registered until the module is collected,
    when Python finalizes (and no thread but the finalizing one runs).  The
    finalizer is found in weakref's own registry of them (a private name of
    every Python ple supports; without it, torch's behaviour stays)."""
    for finalizer in list(getattr(weakref.finalize, "_registry", ())):
        state = finalizer.peek()
        if state is not None and state[0] is library:
            finalizer.atexit = False


_keep_registered_while_python_runs(_lib)


def _kernel(op: str, key: str):
    """Registers the decorated function as ``op``'s kernel for dispatch key
    ``key``.  torch's dispatcher calls a kernel from frames of its own that
    give up and take back the GIL; ``native.call_kernel`` stands between them
    and the kernel's Python code, so that a daemon thread that Python ends in
    that code as the process exits waits there for the process's end instead
    of being unwound through them (which aborts it)."""
    def register(fn):
        _lib.impl(op, functools.partial(native.call_kernel, fn), key)
        return fn
    return register


def _checked(ids: torch.Tensor, handle: str, dtype: torch.dtype | None = None, owner: int = 0
             ) -> tuple[Table, torch.dtype]:
    if sys.is_finalizing():
        raise RuntimeError(EXITING)
    table = table_for_handle(handle)
    if ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"ple.disk_gather: ids must be an int32 or int64 tensor, not {ids.dtype}")
    dtype = table.dtype if dtype is None else dtype
    if dtype not in OUTPUT_DTYPES:
        raise TypeError(f"ple.disk_gather: dtype must be one of {OUTPUT_DTYPES}, not {dtype}")
    if owner < 0:
        raise ValueError(f"ple.disk_gather: owner must be a prefetch owner, an int >= 0 (0: none), "
                         f"not {owner}")
    return table, dtype


def checked_ids(ids, caller: str) -> torch.Tensor:
    """``ids`` as a tensor (``torch.as_tensor``: a list or an array too), for
    a call of ``caller`` that gathers them: a RuntimeError once Python is
    finalizing (``EXITING``), and ``check_dense_ids``' TypeError for sparse
    and nested ids.  Traceable: a compiled caller checks the layout only."""
    if not torch.compiler.is_compiling() and sys.is_finalizing():
        raise RuntimeError(EXITING)
    ids = torch.as_tensor(ids)
    check_dense_ids(ids, caller)
    return ids


def gather(table: Table, ids, dtype: torch.dtype | None = None, round_scale: bool = False
           ) -> torch.Tensor:
    """The rows ``ids`` of ``table``, ``[*ids.shape, table.cols]`` in ``dtype``
    (default ``table.dtype``) on the ids' device: ``torch.ops.ple.disk_gather``
    for a table rather than its handle (``round_scale``: the module's docstring)."""
    if not isinstance(table, Table):
        raise TypeError(f"ple.gather takes a ple.Table, not {type(table).__name__} (the operators "
                        "take table.handle)")
    # Here too: torch.inference_mode sends a jagged nested tensor to its own
    # dispatch, which knows no ple operator.
    ids = checked_ids(ids, "ple.gather")
    return torch.ops.ple.disk_gather(ids, table.handle, dtype, round_scale)


@_kernel("disk_gather_bytes", "CPU")
def _disk_gather_bytes_cpu(ids: torch.Tensor, table: str) -> torch.Tensor:
    checked, _ = _checked(ids, table)
    return checked.gather_bytes(ids)


@_kernel("disk_gather", "CPU")
def _disk_gather_cpu(ids: torch.Tensor, table: str, dtype: torch.dtype | None = None,
                     round_scale: bool = False, scale: float | None = None, owner: int = 0
                     ) -> torch.Tensor:
    checked, dtype = _checked(ids, table, dtype, owner)
    return decode_rows(checked.gather_bytes(ids, owner=owner), checked.row_format,
                       _applied(checked, dtype, round_scale, scale), dtype)


@_kernel("disk_gather", "CUDA")
def _disk_gather_cuda(ids: torch.Tensor, table: str, dtype: torch.dtype | None = None,
                      round_scale: bool = False, scale: float | None = None, owner: int = 0
                      ) -> torch.Tensor:
    from .disk_gather_cuda import disk_gather_cuda  # needs triton, which only CUDA calls need

    checked, dtype = _checked(ids, table, dtype, owner)
    return disk_gather_cuda(checked, ids, dtype, _applied(checked, dtype, round_scale, scale),
                            owner)


def _applied(table: Table, dtype: torch.dtype, round_scale: bool, scale: float | None) -> float:
    return applied_scale(table.scale if scale is None else float(scale), dtype, round_scale)


@torch.library.register_fake("ple::disk_gather_bytes", lib=_lib)
def _disk_gather_bytes_fake(ids: torch.Tensor, table: str) -> torch.Tensor:
    checked, _ = _checked(ids, table)
    return ids.new_empty((*ids.shape, checked.row_bytes), dtype=torch.uint8)


@torch.library.register_fake("ple::disk_gather", lib=_lib)
def _disk_gather_fake(ids: torch.Tensor, table: str, dtype: torch.dtype | None = None,
                      round_scale: bool = False, scale: float | None = None, owner: int = 0
                      ) -> torch.Tensor:
    checked, dtype = _checked(ids, table, dtype, owner)
    return ids.new_empty((*ids.shape, checked.cols), dtype=dtype)


def _refusing_layouts(op: str):
    """The kernel of ``op`` for sparse and nested ids, which reach the operators
    through the dispatch keys of their layouts, where torch would say only
    that no kernel is registered for them."""
    def refuse(ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        check_dense_ids(ids, f"ple.{op}")
        raise AssertionError(f"only sparse and nested ids reach this kernel, not {ids.layout}")
    return refuse


for _op in ("disk_gather", "disk_gather_bytes"):
    for _key in ("SparseCPU", "SparseCUDA", "SparseCsrCPU", "SparseCsrCUDA", "NestedTensorCPU",
                 "NestedTensorCUDA", "AutogradNestedTensor"):
        _kernel(_op, _key)(_refusing_layouts(_op))
