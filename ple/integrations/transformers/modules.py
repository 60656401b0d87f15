"""The modules ple puts in place of a transformers model's embeddings, and
the swap: which embeddings can be served (``nn.Embedding`` and transformers'
``*ScaledWordEmbedding``, untied, no ``max_norm``), the replacement that
keeps each one's lookup bit for bit, the tensor-parallel plans that must
leave it alone, and the warning where transformers alone would not scale an
FP8 table."""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from ple.config import GatherConfig
from ple.layers.disk_embedding import DTYPES, DiskEmbedding
from ple.table import Table

from ..families import auto_module_names

logger = logging.getLogger(__name__)

# llama.cpp's name of the per-layer table of Gemma 3n and Gemma 4 (gguf's
# MODEL_TENSOR.PER_LAYER_TOKEN_EMBD), which ple-quantize-table gives a copy.
PER_LAYER_NAME, PER_LAYER_GGUF_NAME = "embed_tokens_per_layer.weight", "per_layer_token_embd.weight"


class ScaledDiskEmbedding(DiskEmbedding):
    """A :class:`DiskEmbedding` that multiplies its rows as transformers'
    ``*ScaledWordEmbedding`` modules do: by the buffer ``embed_scale`` cast to
    the rows' dtype (the Gemma family: ``super().forward(ids) *
    self.embed_scale.to(self.weight.dtype)``), or by a Python float
    ``embed_scale`` (BART and its kin).  ``embed_scale`` is a non-persistent
    buffer, cast by ``.to(dtype)`` as the original's is;
    ``scalar_embed_scale`` is the value it is initialized with."""

    def __init__(self, table: Table, dtype: torch.dtype | None = None, *,
                 embed_scale: torch.Tensor | float, scalar_embed_scale: float | None = None,
                 **kwargs):
        super().__init__(table, dtype, **kwargs)
        if isinstance(embed_scale, torch.Tensor):
            self.register_buffer("embed_scale", embed_scale, persistent=False)
        elif isinstance(embed_scale, float):
            self.embed_scale = embed_scale
        else:
            raise TypeError(f"embed_scale must be a tensor or a float, not {type(embed_scale).__name__}")
        self.scalar_embed_scale = scalar_embed_scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = super().forward(ids)
        if isinstance(self.embed_scale, torch.Tensor):
            return rows * self.embed_scale.to(self.dtype)
        return rows * self.embed_scale

    @torch.no_grad()
    def reset_scale(self) -> None:
        """Also sets ``embed_scale`` to ``scalar_embed_scale`` as transformers'
        ``_init_weights`` does (``init.constant_``): transformers' loader
        replaces every non-persistent buffer with an empty one and initializes
        only the modules of its own classes."""
        super().reset_scale()
        if isinstance(self.embed_scale, torch.Tensor) and self.scalar_embed_scale is not None:
            self.embed_scale.fill_(self.scalar_embed_scale)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scalar_embed_scale={self.scalar_embed_scale}"


def tables(model: nn.Module) -> dict[str, Table]:
    """The ple tables of ``model``'s offloaded modules, by module name."""
    return {name: module.table for name, module in model.named_modules()
            if isinstance(module, DiskEmbedding)}


def close_tables(model: nn.Module) -> None:
    """Closes every table of ``model`` (their modules cannot run after)."""
    for module in model.modules():
        if isinstance(module, DiskEmbedding):
            module.close()


def replace_with_disk_embeddings(model: nn.Module, keys, names, gather_config: GatherConfig | None,
                                 process_group, round_scale: bool,
                                 table_file: str | os.PathLike | None = None
                                 ) -> dict[str, tuple[DiskEmbedding, str]]:
    """Replaces the modules ``names`` ("auto", a name, or names) of ``model``
    with DiskEmbedding modules over their checkpoint tensors (found by
    ``keys``, a :class:`~.keys.CheckpointKeys`), split across
    ``process_group`` (None: not split), and takes them out of the model's
    tensor-parallel plans.  ``table_file``: a GGUF file holding a copy of the
    one table served (:func:`copy_of_table`), which the module gathers from
    instead.  Returns ``{name: (module, tensor)}``; every table opened is
    closed again if one of them fails."""
    if isinstance(names, str) and names == "auto":
        names = [name for name in auto_module_names(model)
                 if not isinstance(model.get_submodule(name), DiskEmbedding)]
    elif isinstance(names, str):
        names = [names]
    names = list(dict.fromkeys(names))
    if table_file is not None and len(names) != 1:
        raise ValueError(f"table_file= holds one table, and {len(names)} modules are to be "
                         f"served ({names}): name the one it is a copy of in offload=")
    originals = {name: _offloadable(model, name) for name in names}
    done: dict[str, tuple[DiskEmbedding, str]] = {}
    try:
        for name, original in originals.items():
            tensor, files_of_table, reported = keys.table_of(name)
            table = checkpoint = Table.from_safetensors(files_of_table, tensor, gather_config)
            try:
                if table_file is not None:
                    table = copy_of_table(checkpoint, table_file, gather_config)
                replacement = _replacement(name, original, table, process_group, round_scale,
                                           checkpoint)
            except BaseException:
                for opened in {id(t): t for t in (table, checkpoint)}.values():
                    opened.close()
                raise
            done[name] = (replacement, tensor)
            keys.ignore_unexpected(reported)
            _warn_if_transformers_would_not_scale(model, name, table)
        for name, (replacement, _) in done.items():
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, replacement)
    except BaseException:
        for replacement, _ in done.values():
            replacement.close()
        raise
    _leave_out_of_tp_plans(model, done)
    return done


def copy_of_table(original: Table, path: str | os.PathLike,
                  gather_config: GatherConfig | None) -> Table:
    """The table of the GGUF file ``path`` that is a copy of ``original`` (a
    checkpoint's table; ``ple-quantize-table`` writes such a file): its
    tensor named as llama.cpp names a per-layer table, or as the original,
    or its one 2-D tensor; of the original's shape."""
    from ple.gguf_header import read_gguf_header

    tensors = {name: entry for name, entry in read_gguf_header(Path(path)).tensors.items()
               if len(entry.shape) == 2}
    wanted = [PER_LAYER_GGUF_NAME if original.name.endswith(PER_LAYER_NAME) else None,
              original.name]
    name = next((n for n in wanted if n in tensors), None)
    if name is None and len(tensors) == 1:
        name = next(iter(tensors))
    if name is None:
        raise ValueError(f"{path}: no table that is a copy of {original.name!r}: looked for "
                         f"{[n for n in wanted if n]} or a file of one 2-D tensor, found "
                         f"{sorted(tensors)}")
    copy = Table.from_gguf(path, name, gather_config)
    if (copy.num_rows, copy.cols) != (original.num_rows, original.cols):
        copy.close()
        raise ValueError(f"{path}: {name!r} has {copy.num_rows} rows of {copy.cols}, but the table "
                         f"it stands for, {original.name!r}, has {original.num_rows} rows of "
                         f"{original.cols}")
    return copy


class _TablesWarnedAbout:
    """The tables (by their files' identities and tensor name) a warning has
    been given for in this process, so that it is given once per table
    however many loads open it (a benchmark's arms, a server's reloads)."""

    def __init__(self):
        self._keys: set[tuple] = set()
        self._lock = threading.Lock()

    def first_time(self, table: Table) -> bool:
        """True the first time it is asked about ``table``'s tensor in its files."""
        key = (tuple(table.file_ids), table.name)
        with self._lock:
            first = key not in self._keys
            self._keys.add(key)
        return first


_WARNED_UNSCALED = _TablesWarnedAbout()


def _warn_if_transformers_would_not_scale(model: nn.Module, name: str, table: Table) -> None:
    """ple multiplies a table's fp8/u8/i8 values by its scale; transformers
    does so only where the config's ``quantization_config`` converts the
    module (``modules_to_convert``, matched as name endings, as
    ``replace_with_fp8_embedding`` does), else it loads the stored values
    as they are.  Said once per table in a process, in two lines."""
    if not table.row_format.scaled or table.scale == 1.0:
        return
    quantization = getattr(model.config, "quantization_config", None)
    converted = (quantization.get("modules_to_convert") if isinstance(quantization, dict)
                 else getattr(quantization, "modules_to_convert", None)) or ()
    if any(name.endswith(pattern) for pattern in converted):
        return
    if not _WARNED_UNSCALED.first_time(table):
        return
    logger.warning(
        "ple: %s.from_pretrained alone would load %s (%s) unscaled; ple multiplies it by its "
        "scale %g\n(no quantization_config converts it: text-only classes drop a multimodal "
        "checkpoint's), as the multimodal class and AutoModelForCausalLM do",
        type(model).__name__, table.name, table.format, table.scale)


def _leave_out_of_tp_plans(model: nn.Module, names: Iterable[str]) -> None:
    """Drops the rules of transformers' tensor-parallel plans (``_tp_plan`` of
    the model and of its submodules, keys relative to each) that name the
    modules ``names`` or their parameters.  A rule names a module by its
    name with each layer number as ``*``, so a rule dropped for one layer's
    module no longer shards that module in the other layers either."""
    generic = [_generic(name) for name in names]
    for prefix, module in model.named_modules():
        plan = getattr(module, "_tp_plan", None)
        if not isinstance(plan, dict) or not plan:
            continue
        prefix = _generic(prefix)
        relative = [name.removeprefix(f"{prefix}.") for name in generic
                    if not prefix or name.startswith(f"{prefix}.")]
        module._tp_plan = {rule: style for rule, style in plan.items()
                           if not any(rule == name or rule.startswith(f"{name}.") for name in relative)}


def _offloadable(model: nn.Module, name: str) -> nn.Embedding:
    try:
        module = model.get_submodule(name)
    except AttributeError:
        raise ValueError(f"{type(model).__name__} has no module named {name!r}") from None
    if isinstance(module, DiskEmbedding):
        raise ValueError(f"{name!r} is already served by ple ({module.table.name!r})")
    if not isinstance(module, nn.Embedding):
        raise TypeError(f"{name!r} is a {type(module).__name__}, not an nn.Embedding: ple serves "
                        "embedding lookups only")
    _semantics(name, module)
    if module.max_norm is not None:
        raise ValueError(f"{name!r} has max_norm={module.max_norm}: its lookup rewrites the "
                         "weight, which ple cannot do to a table in its files")
    if module.weight.dtype not in DTYPES:
        raise TypeError(f"{name!r} has a {module.weight.dtype} weight; ple gives rows in {DTYPES}")
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    key = f"{name}.weight"
    for target, source in tied.items():
        if key in (target, source):
            raise ValueError(f"{key!r} is tied to {(source if key == target else target)!r} "
                             "(tie_word_embeddings): the other side needs the table in memory, "
                             "so ple cannot serve it from disk")
    return module


def _semantics(name: str, module: nn.Embedding) -> str:
    """"plain" for a lookup as nn.Embedding's, "scaled" for transformers'
    *ScaledWordEmbedding; anything else is refused."""
    if type(module).forward is nn.Embedding.forward:
        return "plain"
    scale = getattr(module, "embed_scale", None)
    if type(module).__name__.endswith("ScaledWordEmbedding") and (
            isinstance(scale, torch.Tensor) and scale.numel() == 1 or isinstance(scale, float)):
        return "scaled"
    raise TypeError(f"{name!r} is a {type(module).__name__}, a subclass of nn.Embedding with a "
                    "forward of its own, which ple does not know how to keep; ple replaces "
                    "nn.Embedding and transformers' *ScaledWordEmbedding modules")


def _generic(name: str) -> str:
    """``name`` with each layer number as ``*``, as transformers' plans name
    modules (``replace_layer_number_by_wildcard``)."""
    return re.sub(r"\.\d+(\.|$)", r".*\1", name)


def _replacement(name: str, original: nn.Embedding, table: Table, process_group,
                 round_scale: bool, checkpoint: Table) -> DiskEmbedding:
    want = (original.num_embeddings, original.embedding_dim)
    if (table.num_rows, table.cols) != want:
        raise ValueError(f"{name!r} is an embedding of {want[0]} x {want[1]}, but its table "
                         f"{table.name!r} in {', '.join(str(p) for p in table.paths)} has "
                         f"{table.num_rows} rows of {table.cols}")
    weight = original.weight
    device = weight.device if weight.device.type != "meta" else torch.device("cpu")
    kwargs = dict(padding_idx=original.padding_idx, device=device, process_group=process_group,
                  round_scale=round_scale, checkpoint=checkpoint)
    if _semantics(name, original) == "plain":
        return DiskEmbedding(table, weight.dtype, **kwargs)
    scale = original.embed_scale
    scalar = getattr(original, "scalar_embed_scale", None)
    if isinstance(scale, torch.Tensor):
        if scale.device.type != "meta":
            scale = scale.detach().clone()
        elif scalar is None:
            raise ValueError(f"{name!r}: embed_scale is on the meta device and the module has no "
                             "scalar_embed_scale to make it from")
        else:
            scale = torch.full(scale.shape, scalar, dtype=scale.dtype, device=device)
    return ScaledDiskEmbedding(table, weight.dtype, embed_scale=scale, scalar_embed_scale=scalar,
                               **kwargs)
