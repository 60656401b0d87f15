"""transformers models whose embedding tables stay in the checkpoint's files.

    from transformers import AutoModelForCausalLM, Qwen4ExpForCausalLM
    from ple.integrations.transformers import from_pretrained, tables

    model = from_pretrained(Qwen4ExpForCausalLM, "checkpoint/", dtype=torch.bfloat16)
    model = from_pretrained(AutoModelForCausalLM, "google/gemma-3n-E4B-it")  # from the hub's cache
    model.to("cuda")                       # the tables stay on disk; ids on CUDA reach ple's CUDA kernel
    tables(model)                          # {module name: ple.Table}, for place(), config, stats()

``from_pretrained`` loads a model from a safetensors checkpoint on disk (a
directory, or a repo id that huggingface_hub's cache holds) as
``model_class.from_pretrained`` does, but for the embeddings it offloads:
their modules become :class:`ple.layers.DiskEmbedding` (no parameters), whose
rows ``torch.ops.ple.disk_gather`` reads from the checkpoint's files as the
model runs.  Those tensors are never read whole, concatenated, nor copied to
an offload folder.  ``offload="auto"`` offloads the tables ple is made for:
every Qwen4Exp n-gram table (``Qwen4ExpTextNGramEmbedding.ngram_embedding``,
in the checkpoint a shard family ``....ngram_embedding.shard_{i}.weight`` that
transformers would concatenate in memory) and every ``embed_tokens_per_layer``
embedding (Gemma 3n's per-layer inputs).  A list of module names offloads
those ``nn.Embedding`` modules instead.  :func:`offload` does the same to a
model already built (on the meta device, say).

How: transformers builds the model on the meta device, then loads each
checkpoint tensor that matches a parameter; a tensor that matches none is
reported "unexpected" and never read.  ``from_pretrained`` therefore loads
through a subclass of ``model_class`` made for the call (same name and
module, so ``config.architectures`` and transformers' weight conversions stay
those of ``model_class``; the model is given back as a ``model_class``) whose
``__init__`` swaps the offloaded modules for ``DiskEmbedding`` modules over
tables opened from the checkpoint's headers, and whose
``_keys_to_ignore_on_load_unexpected`` covers their tensors, so that
transformers neither reads them nor warns about them.  An auto class
(``AutoModelForCausalLM``, ``AutoModelForImageTextToText``, ``AutoModel``,
...) is resolved first to the class transformers would build for the
checkpoint's config (its own mapping), and loads through transformers' auto
logic with that class swapped for the loading one: a text-only class on a
multimodal checkpoint gets the text config with the checkpoint's
``quantization_config``, as with transformers alone.  When "auto" would
leave a table that it serves to be loaded into memory (no module of the
model takes it), ``from_pretrained`` raises before anything is read.

Published layouts: a multimodal checkpoint (Gemma 3n E4B's
``Gemma3nForConditionalGeneration``, Qwen3.8-Flash-Next's
``Qwen4ExpForConditionalGeneration``) keeps its text model under
``model.language_model.*``; its own class and the text-only classes
(``Gemma3nForCausalLM``, ``Qwen4ExpForCausalLM``, for which transformers
strips ``language_model``) both load it.  Gemma 3n's multimodal classes build
their vision tower with timm, which must be installed (with a torchvision
built for the installed torch); the text-only class needs neither.

FP8 tables: ple multiplies FP8 rows by their ``weight_scale``, as
transformers' ``FP8Embedding`` does when the config's ``quantization_config``
converts the module, and with its arithmetic: in the model's dtype, by the
scale cast to that dtype (its loader casts the F32 ``weight_scale``), so
``values.to(dtype) * scale.to(dtype)`` (``round_scale=True``, the default of
:func:`from_pretrained` and :func:`offload`; ``round_scale=False`` gives the
float32 product cast to the dtype instead).  The module keeps that scale in
a ``weight_scale`` buffer that the model's casts (``.to(dtype)``,
``.half()``, ``.float()``, ...) cast as they cast ``FP8Embedding``'s, so
the arithmetic stays transformers' after any cast.  Where it does not convert it
(``Qwen4ExpForCausalLM`` given a multimodal FP8 checkpoint directly:
transformers drops that checkpoint's ``quantization_config`` and loads the
values unscaled, a transformers bug; or a checkpoint with a scale and no
``quantization_config``), ple's outputs
are those of the multimodal class and of ``AutoModelForCausalLM``, not of
``model_class.from_pretrained`` alone, and a warning says so.

What each module did is kept: an ``nn.Embedding``'s lookup bit for bit, in
the dtype its weight would have had (``dtype=torch.bfloat16`` of an fp32
checkpoint: torch's own cast of the stored values); Gemma's
``*ScaledWordEmbedding`` multiplies by ``embed_scale`` cast to that dtype, as
the original does; a Qwen4Exp n-gram module keeps its own ids, hashing and
flatten, only its inner ``ngram_embedding`` is replaced.  Other subclasses of
``nn.Embedding`` with a forward of their own are refused, as are tied weights
(the other side of the tie would need the table in memory) and ``max_norm``.

Several GPUs: ``process_group=`` splits every offloaded table by rows across
the group's ranks (``ple.layers.parallel``: each rank gathers its own rows,
an all_reduce sums the shares, every rank gets the whole embedding), and
``module.place(...)`` keeps a rank's own rows in its tiers.  transformers'
own tensor parallelism (``tp_plan``) leaves the offloaded modules alone:
their rules are taken out of the model's plan (Qwen4Exp's would split the
n-gram table by columns, and its hooks would hand ple's gather DTensors),
so a table is whole on every rank without ``process_group``, split by rows
with it.

``save_pretrained`` of such a model writes it without the offloaded tables
(they are not parameters): keep the original checkpoint.  transformers'
save_pretrained overwrites ``model.safetensors`` and deletes the shards of
an earlier save that it does not write again, which would take the tables'
files; so once ple serves a model, transformers' saving (of any model, by
any route: ``model.save_pretrained``, the class's function,
``PreTrainedModel.save_pretrained(model, ...)``, a ``Trainer``) raises
``ValueError``, naming the tables, before writing anything into a directory
that holds a file a ple table of the process is served from, and never
deletes nor overwrites such a file.  Files are told by their identity
(device, inode), so a symlink, a relative path or another working
directory names the same file.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import threading
import types
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from ple.config import GatherConfig
from ple.layers.disk_embedding import DTYPES, DiskEmbedding
from ple.layers.lookahead import DEFAULT_MAX_BYTES as DEFAULT_LOOKAHEAD_BYTES
from ple.layers.lookahead import lookahead_mib as checked_lookahead_mib
from ple.safetensors_header import TensorEntry
from ple.safetensors_tables import closest_names, describe_files
from ple.table import SHARD_NAME, Table, read_checkpoint_entries, tables_held

from . import prefill_lookahead

logger = logging.getLogger(__name__)

__all__ = ["ScaledDiskEmbedding", "close_tables", "from_pretrained", "offload", "tables"]

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
# transformers' from_pretrained arguments that say where a hub checkpoint is;
# ple takes them to find the snapshot in huggingface_hub's cache, and gives
# transformers that snapshot's folder.
HUB_ARGUMENTS = ("revision", "cache_dir", "token", "force_download", "local_files_only")
# The last names of the tables offload="auto" serves: Qwen4Exp's n-gram
# tables (shard families, or one tensor) and Gemma 3n's per-layer inputs.
AUTO_TABLES = ("ngram_embedding", "embed_tokens_per_layer")


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
                 padding_idx: int | None = None, device: torch.device | str | None = None,
                 process_group=None, round_scale: bool = False):
        super().__init__(table, dtype, padding_idx=padding_idx, device=device,
                         process_group=process_group, round_scale=round_scale)
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


class _Served:
    """What ple keeps on a model it serves (``model._ple_served``): the
    lookahead bound of its ``generate``.  A copy of the model (deepcopy,
    pickle, torch.load, a spawned worker) carries it, and its unpickling
    guards transformers' saving (:func:`_guard_saving`) and gives the
    model's class ple's ``generate`` (:func:`_give_generate`) in that
    process too."""

    def __init__(self, model_class: type, lookahead_bytes: int):
        self.model_class = model_class
        self.lookahead_bytes = lookahead_bytes

    def __reduce__(self):
        return _served, (self.model_class, self.lookahead_bytes)


_install_lock = threading.Lock()


def _served(model_class: type, lookahead_bytes: int) -> _Served:
    """The :class:`_Served` of a model of ``model_class``, with ple's save
    guard and ``generate`` in place."""
    with _install_lock:
        _guard_saving()
        _give_generate(model_class)
    return _Served(model_class, lookahead_bytes)


def _serve(model: nn.Module, lookahead_mib: int) -> None:
    """Marks ``model`` (whose tables ple serves) as ple's: its generate
    looks ahead ``lookahead_mib`` MiB, and transformers' saving is guarded."""
    model._ple_served = _served(type(model), _lookahead_bytes(lookahead_mib))


def _give_generate(model_class: type) -> None:
    """Makes ``model_class.generate`` a function that, for a model ple
    serves with a lookahead bound and a prefill chunk size
    (``prefill_chunk_size=`` or the generation config's), has the offloaded
    modules read each coming chunk's rows while the one before computes,
    at most that bound ahead each (``ple.integrations.prefill_lookahead``),
    and generates as the class's own ``generate`` does; for any other model
    it is that ``generate``.  A function of the class, not an attribute of
    the model, so that whatever a user keeps of it (``model.generate``, a
    ``functools.partial`` of it, the class's function) holds the model as
    transformers' own method does, and the model holds nothing that refers
    back to it.  Nothing read ahead outlives the call."""
    generate = getattr(model_class, "generate", None)
    if not callable(generate) or getattr(generate, "__ple_generate__", False):
        return

    @functools.wraps(generate)
    def generate_with_lookahead(self, inputs: torch.Tensor | None = None, *args, **kwargs):
        served = self.__dict__.get("_ple_served")
        lookahead_bytes = served.lookahead_bytes if isinstance(served, _Served) else 0
        prompt = inputs if inputs is not None else kwargs.get("input_ids")
        chunk_size = prefill_lookahead.prefill_chunk_size(self, kwargs)
        planned = []
        if lookahead_bytes and chunk_size and isinstance(prompt, torch.Tensor):
            planned = prefill_lookahead.start(self, prompt, chunk_size, lookahead_bytes,
                                              kwargs.get("attention_mask"))
        try:
            return generate(self, inputs, *args, **kwargs)
        finally:
            prefill_lookahead.end(planned)

    generate_with_lookahead.__ple_generate__ = True
    model_class.generate = generate_with_lookahead


def _lookahead_bytes(lookahead_mib: int) -> int:
    return checked_lookahead_mib(lookahead_mib, "lookahead_mib") << 20


# ---- transformers' saving ----------------------------------------------------
#
# transformers' save_pretrained (every route to it: model.save_pretrained, the
# class's function, PreTrainedModel.save_pretrained unbound, a Trainer) creates
# its directory with os.makedirs before it writes anything, deletes the shards
# of an earlier save with os.remove and writes shards with safe_save_file, all
# three names of transformers.modeling_utils; a Trainer saving a model that is
# no PreTrainedModel creates its directory with os.makedirs and writes with
# safetensors.torch.save_file, names of transformers.trainer.  ple gives those
# modules an ``os``, a ``safe_save_file`` and a ``safetensors`` that refuse, by
# the files' identity (device, inode), any file a ple table of this process is
# served from: a directory that holds one, and such a file itself (a symlink
# to it too).  For every other path they are os's and safetensors' own.

def _guard_saving() -> None:
    """Puts ple's guard into transformers' saving, once a process (nothing
    without transformers)."""
    try:
        from transformers import modeling_utils, trainer
    except ImportError:
        return
    for module in (modeling_utils, trainer):
        if not isinstance(module.os, _Guarded):
            module.os = _SAVING_OS
    if not getattr(modeling_utils.safe_save_file, "__ple_guard__", False):
        modeling_utils.safe_save_file = _guarded_save_file(modeling_utils.safe_save_file)
    if not isinstance(trainer.safetensors, _Guarded):
        safetensors = trainer.safetensors
        trainer.safetensors = _Guarded(safetensors, torch=_Guarded(
            safetensors.torch, save_file=_guarded_save_file(safetensors.torch.save_file)))


class _Guarded(types.ModuleType):
    """``module`` as transformers' modules see it: the names given are ple's
    guarded ones, every other name is the module's own."""

    def __init__(self, module: types.ModuleType, **guarded):
        super().__init__(module.__name__, module.__doc__)
        self.__dict__.update(guarded, _module=module)

    def __getattr__(self, name: str):
        return getattr(self.__dict__["_module"], name)


def _makedirs(name, *args, **kwargs):
    """os.makedirs, refusing a directory that holds a file a ple table is served from."""
    _refuse_directory_of_tables(name)
    return os.makedirs(name, *args, **kwargs)


def _remove(path, *args, **kwargs):
    """os.remove, refusing a file a ple table is served from."""
    _refuse_file_of_tables(path, "delete")
    return os.remove(path, *args, **kwargs)


_SAVING_OS = _Guarded(os, makedirs=_makedirs, remove=_remove)


def _guarded_save_file(save_file):
    """``save_file`` (safetensors'), refusing to overwrite a file a ple table
    is served from."""

    @functools.wraps(save_file)
    def guarded(tensors, filename, *args, **kwargs):
        _refuse_file_of_tables(filename, "overwrite")
        return save_file(tensors, filename, *args, **kwargs)

    guarded.__ple_guard__ = True
    return guarded


def _served_files() -> dict[tuple[int, int], set[str]]:
    """``(device, inode)`` of every file that a table of this process not
    yet dropped (open, or closed and still held by a model) is served from,
    to the names of those tables."""
    served: dict[tuple[int, int], set[str]] = {}
    for table in tables_held():
        for file_id in table.file_ids:
            served.setdefault(file_id, set()).add(table.name)
    return served


def _file_id(path) -> tuple[int, int] | None:
    """``(device, inode)`` of the file ``path`` names (a symlink's target),
    None where there is none."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino


def _refuse_directory_of_tables(directory) -> None:
    """A ValueError when ``directory`` holds (by any name, a symlink
    included) a file a ple table is served from."""
    served = _served_files()
    if not served or not os.path.isdir(directory):
        return
    names: set[str] = set()
    with os.scandir(directory) as entries:
        for entry in entries:
            names |= served.get(_file_id(entry.path), set())
    if names:
        raise ValueError(
            f"save_pretrained: {directory} holds the files of {_tables_named(names)}, which ple "
            "serves from there; transformers' save_pretrained would overwrite or delete them (it "
            "writes model.safetensors, and deletes the shards of an earlier save that it does not "
            f"write again). {SAVE_ELSEWHERE}")


def _refuse_file_of_tables(path, doing: str) -> None:
    """A ValueError when ``path`` is (or links to) a file a ple table is
    served from; ``doing``: what transformers was about to do to it."""
    names = _served_files().get(_file_id(path))
    if names:
        raise ValueError(f"save_pretrained: {path} is a file of {_tables_named(names)}, which "
                         f"ple serves from it; transformers was about to {doing} it. "
                         f"{SAVE_ELSEWHERE}")


SAVE_ELSEWHERE = ("Save into another directory: a model that ple serves is saved without its "
                  "offloaded tables, so keep this checkpoint too")


def _tables_named(names: set[str]) -> str:
    shown = sorted(names)
    listed = ", ".join(shown[:3]) + (f" and {len(shown) - 3} more" if len(shown) > 3 else "")
    return f"{len(shown)} ple table{'' if len(shown) == 1 else 's'} ({listed})"


def from_pretrained(model_class, path: str | os.PathLike, *, offload: str | Iterable[str] = "auto",
                    gather_config: GatherConfig | None = None, process_group=None,
                    round_scale: bool = True,
                    lookahead_mib: int = DEFAULT_LOOKAHEAD_BYTES >> 20, **kwargs):
    """``model_class.from_pretrained(path, **kwargs)`` with the tables of
    ``offload`` ("auto", or module names such as ``"model.embed_tokens"``)
    left in the checkpoint's files and served by ple, each table opened with
    ``gather_config`` and split by rows across the ranks of
    ``process_group`` when given (a ``torch.distributed`` group, which must
    exist before the call: with ``tp_plan``, initialize the default group
    first and transformers uses it).  ``round_scale``: the arithmetic of
    FP8, U8 and I8 tables (:class:`ple.layers.DiskEmbedding`'s); True is
    that of transformers' ``FP8Embedding``.

    ``model_class`` is a transformers model class or an auto class
    (``AutoModelForCausalLM``, ...), which is resolved as transformers
    resolves it, from the checkpoint's config.  ``path`` is a local
    directory of a safetensors checkpoint (``model.safetensors`` or a
    sharded one with its index; ``subfolder=`` and ``variant=`` are
    honoured), or a hub repo id (``"google/gemma-3n-E4B-it"``) whose
    snapshot huggingface_hub's cache holds (``revision=``, ``cache_dir=``;
    offline: ``local_files_only=False`` lets it download the snapshot's
    ``*.json`` and ``*.safetensors`` files first).  The model comes back as
    the concrete class; ``model.ple_offloaded`` maps each offloaded module's
    name to the tensor or shard family it reads, and :func:`tables` gives
    the tables.  With ``"auto"`` and a checkpoint that has no table it
    serves, the model loads as usual (a warning says so); a table it serves
    that no module of the model would take is a ValueError, raised before
    any weight is read.

    ``lookahead_mib``: in ``model.generate(..., prefill_chunk_size=N)``, each
    offloaded module reads the rows of the prompt's coming chunks while the
    one before computes, at most this many MiB ahead (0: not at all;
    ``ple.integrations.prefill_lookahead``)."""
    _lookahead_bytes(lookahead_mib)  # a bad value raises before anything is read
    for unsupported in ("gguf_file", "state_dict"):
        if kwargs.get(unsupported) is not None:
            raise ValueError(f"ple.integrations.transformers.from_pretrained serves tables from "
                             f"safetensors checkpoint files; {unsupported}= is not supported")
    if kwargs.get("use_safetensors") is False:
        raise ValueError("ple serves tables from safetensors files; use_safetensors=False is not "
                         "supported")
    path = _local_checkpoint(path, kwargs)
    directory = Path(path, kwargs.get("subfolder") or "")
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: not a local checkpoint directory (ple maps the "
                                "checkpoint's own files, so it loads checkpoints on disk only)")
    auto_class = model_class if _is_auto_class(model_class) else None
    if auto_class is not None:
        auto_config, model_class = _resolved_auto_class(auto_class, path, kwargs)
    _check_backends(model_class)
    files = checkpoint_files(directory, kwargs.get("variant"))
    entries = read_checkpoint_entries(files)
    opened: list[DiskEmbedding] = []
    found: dict[str, str] = {}

    def swap_in(model):
        where = _Keys(model, entries, files, kwargs.get("key_mapping"))
        swapped = _swap(model, where, offload, gather_config, process_group, round_scale)
        opened.extend(module for module, _ in swapped.values())
        found.update({name: tensor for name, (_, tensor) in swapped.items()})
        if isinstance(offload, str) and offload == "auto":
            where.refuse_tables_left(swapped)

    loading_class = _loading_class(model_class, swap_in)
    loader = (loading_class if auto_class is None
              else _auto_loader(auto_class, auto_config, loading_class))
    try:
        loaded = loader.from_pretrained(path, **kwargs)
    except BaseException:
        for module in opened:
            module.close()
        raise
    model = loaded[0] if isinstance(loaded, tuple) else loaded
    if type(model) is loading_class:
        model.__class__ = model_class
    for module in opened:  # their non-persistent buffers were replaced by empty ones
        module.reset_scale()
    model.ple_offloaded = found
    if found:
        _serve(model, lookahead_mib)
    _report(found, model, directory, offload)
    return loaded


def offload(model: nn.Module, path: str | os.PathLike | Iterable[str | os.PathLike],
            names: str | Iterable[str] = "auto", *, gather_config: GatherConfig | None = None,
            key_mapping: dict[str, str] | None = None, process_group=None,
            round_scale: bool = True,
            lookahead_mib: int = DEFAULT_LOOKAHEAD_BYTES >> 20) -> dict[str, Table]:
    """Swaps the embeddings ``names`` ("auto", or module names) of a model
    already built, on the meta device or not, for :class:`DiskEmbedding`
    modules over their tables in the checkpoint ``path`` (a directory as for
    :func:`from_pretrained`, or safetensors files).  The new modules' buffers
    are on the old weights' device (the CPU for a meta weight).  Returns the
    tables it opened by module name, and records them in
    ``model.ple_offloaded`` as :func:`from_pretrained` does.  ``process_group``
    ``round_scale`` and ``lookahead_mib`` as for :func:`from_pretrained`; a model that transformers has already
    distributed keeps the tensor-parallel hooks it installed, so offload
    before distributing it."""
    _lookahead_bytes(lookahead_mib)
    if isinstance(path, (str, os.PathLike)) and Path(path).is_dir():
        files = checkpoint_files(Path(path))
    else:
        items = [path] if isinstance(path, (str, os.PathLike)) else list(path)
        files = [Path(p) for p in items]
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(f"{file}: no such checkpoint file")
    where = _Keys(model, read_checkpoint_entries(files), files, key_mapping)
    swapped = _swap(model, where, names, gather_config, process_group, round_scale)
    offloaded = dict(getattr(model, "ple_offloaded", None) or {})
    offloaded.update({name: tensor for name, (_, tensor) in swapped.items()})
    model.ple_offloaded = offloaded
    if offloaded:
        _serve(model, lookahead_mib)
    _report({name: tensor for name, (_, tensor) in swapped.items()}, model, files[0].parent, names)
    return {name: module.table for name, (module, _) in swapped.items()}


def checkpoint_files(directory: Path, variant: str | None = None) -> list[Path]:
    """The safetensors files transformers would load from ``directory``: those
    of ``model.safetensors.index.json``, else ``model.safetensors``."""
    index = directory / _add_variant(SAFE_WEIGHTS_INDEX_NAME, variant)
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: no weight_map")
        return [directory / name for name in sorted(set(weight_map.values()))]
    single = directory / _add_variant(SAFE_WEIGHTS_NAME, variant)
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"{directory}: neither {index.name} nor {single.name}: ple serves "
                            "tables from safetensors checkpoints")


def _add_variant(name: str, variant: str | None) -> str:
    if variant is None:
        return name
    stem, ext = name.split(".", 1)
    return f"{stem}.{variant}.{ext}"


def _local_checkpoint(path: str | os.PathLike, kwargs: dict) -> str | os.PathLike:
    """``path`` when it is a local directory, else the folder of the snapshot
    of the hub repo ``path`` in huggingface_hub's cache (its files are links
    into the cache's blobs, which ple maps as any file); the hub arguments
    are taken out of ``kwargs``, as that folder is what transformers then
    loads.  Nothing is downloaded unless ``local_files_only=False``."""
    if Path(path).is_dir():
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(str(path))
    except HFValidationError:
        raise FileNotFoundError(f"{path}: not a local checkpoint directory, nor a hub repo id "
                                "(ple maps the checkpoint's own files, so it loads checkpoints on "
                                "disk only)") from None
    hub = {name: kwargs.pop(name) for name in HUB_ARGUMENTS if name in kwargs}
    offline = hub.pop("local_files_only", True)
    subfolder = kwargs.get("subfolder") or ""
    patterns = [f"{subfolder}/*{ext}" if subfolder else f"*{ext}" for ext in (".json", ".safetensors")]
    try:
        return snapshot_download(str(path), local_files_only=offline, allow_patterns=patterns, **hub)
    except LocalEntryNotFoundError:
        from huggingface_hub import constants

        raise FileNotFoundError(
            f"{path}: not a local directory, and huggingface_hub's cache "
            f"({hub.get('cache_dir') or constants.HF_HUB_CACHE}) has no snapshot of it at revision "
            f"{hub.get('revision') or 'main'!r}: download it first (hf download {path}), or pass "
            "local_files_only=False to let from_pretrained download it") from None


def _is_auto_class(model_class) -> bool:
    try:
        from transformers.models.auto.auto_factory import _BaseAutoModelClass
    except ImportError:
        return False
    return isinstance(model_class, type) and issubclass(model_class, _BaseAutoModelClass)


def _resolved_auto_class(auto_class, path, kwargs: dict):
    """``(config, model class)``: the class ``auto_class.from_pretrained(path,
    **kwargs)`` builds, chosen by transformers' own mapping from the
    checkpoint's config (``config=`` when given), as its ``from_pretrained``
    chooses it."""
    from transformers import AutoConfig, PreTrainedConfig
    from transformers.models.auto.auto_factory import _get_model_class

    config = kwargs.get("config")
    if not isinstance(config, PreTrainedConfig):
        config = AutoConfig.from_pretrained(path, subfolder=kwargs.get("subfolder") or "",
                                            trust_remote_code=kwargs.get("trust_remote_code"))
    remote = kwargs.get("trust_remote_code") and auto_class.__name__ in (
        getattr(config, "auto_map", None) or {})
    if remote or type(config) not in auto_class._model_mapping:
        raise ValueError(f"{auto_class.__name__} has no transformers class for "
                         f"{type(config).__name__} (model_type {config.model_type!r}) of {path}"
                         f"{' but remote code' if remote else ''}: ple resolves auto classes to "
                         "transformers' own classes; pass the model class itself")
    return config, _get_model_class(config, auto_class._model_mapping)


def _auto_loader(auto_class, config, loading_class):
    """``auto_class`` with a mapping that gives ``loading_class`` for the
    checkpoint's config class, so that transformers' own auto
    ``from_pretrained`` (a multimodal config's text part for a text-only
    class, with the checkpoint's quantization_config; the dtype) loads
    through it."""
    return type(auto_class.__name__, (auto_class,),
                {"_model_mapping": {type(config): loading_class}, "__module__": __name__})


def _check_backends(model_class) -> None:
    """An ImportError, before anything is opened, when ``model_class`` builds
    a timm model (Gemma 3n's vision tower) and timm is missing; it names
    the text-only class that needs none."""
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_MAPPING_NAMES)
    from transformers.utils import is_timm_available

    sub_configs = getattr(getattr(model_class, "config_class", None), "sub_configs", None) or {}
    needs_timm = [key for key, sub in sub_configs.items()
                  if MODEL_MAPPING_NAMES.get(getattr(sub, "model_type", None)) == "TimmWrapperModel"]
    if not needs_timm or is_timm_available():
        return
    text = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(sub_configs.get("text_config"),
                                                         "model_type", None))
    instead = f"; for text only, load the checkpoint with {text}, which needs no timm" if text else ""
    tower = needs_timm[0].removesuffix("_config")
    raise ImportError(f"{model_class.__name__} builds its {tower} tower with timm, which is not "
                      "installed (pip install timm, which needs a torchvision built for the "
                      f"installed torch){instead}")


def _loading_class(model_class, swap_in):
    """A subclass of ``model_class`` whose ``__init__`` calls ``swap_in`` on
    the model it has built.  Same ``__name__``, ``__qualname__`` and
    ``__module__``: transformers picks its weight conversions by class name
    and skips them for classes outside its own modules (``is_custom_code``)."""
    if not (isinstance(model_class, type) and hasattr(model_class, "from_pretrained")):
        raise TypeError(f"model_class must be a transformers model class, not {model_class!r}")

    def __init__(self, config, *args, **kwargs):
        model_class.__init__(self, config, *args, **kwargs)
        swap_in(self)

    return type(model_class.__name__, (model_class,),
                {"__init__": __init__, "__module__": model_class.__module__,
                 "__qualname__": model_class.__qualname__,
                 "__doc__": model_class.__doc__})


def auto_names(model: nn.Module) -> list[str]:
    """The modules ``offload="auto"`` offloads: the ``ngram_embedding`` of
    every Qwen4Exp n-gram module, and every ``nn.Embedding`` named
    ``embed_tokens_per_layer`` (Gemma 3n's per-layer inputs)."""
    names = []
    for name, module in model.named_modules():
        if type(module).__name__.endswith("NGramEmbedding") and isinstance(
                getattr(module, "ngram_embedding", None), (nn.Embedding, DiskEmbedding)):
            names.append(f"{name}.ngram_embedding" if name else "ngram_embedding")
        elif name.rsplit(".", 1)[-1] == "embed_tokens_per_layer" and isinstance(
                module, (nn.Embedding, DiskEmbedding)):
            names.append(name)
    return names


def _swap(model: nn.Module, where: "_Keys", names, gather_config: GatherConfig | None,
          process_group, round_scale: bool) -> dict[str, tuple[DiskEmbedding, str]]:
    """Replaces the modules ``names`` of ``model`` with DiskEmbedding modules
    over their checkpoint tensors (found by ``where``), split across
    ``process_group`` (None: not split), and takes them out of the model's
    tensor-parallel plans.  Returns ``{name: (module, tensor)}``; every
    table opened is closed again if one of them fails."""
    if isinstance(names, str) and names == "auto":
        names = [name for name in auto_names(model)
                 if not isinstance(model.get_submodule(name), DiskEmbedding)]
    elif isinstance(names, str):
        names = [names]
    names = list(dict.fromkeys(names))
    originals = {name: _offloadable(model, name) for name in names}
    done: dict[str, tuple[DiskEmbedding, str]] = {}
    try:
        for name, original in originals.items():
            tensor, files_of_table, reported = where.table_of(name)
            table = Table.from_safetensors(files_of_table, tensor, gather_config)
            try:
                replacement = _replacement(name, original, table, process_group, round_scale)
            except BaseException:
                table.close()
                raise
            done[name] = (replacement, tensor)
            where.ignore_unexpected(reported)
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
                 round_scale: bool) -> DiskEmbedding:
    want = (original.num_embeddings, original.embedding_dim)
    if (table.num_rows, table.cols) != want:
        raise ValueError(f"{name!r} is an embedding of {want[0]} x {want[1]}, but its table "
                         f"{table.name!r} in {', '.join(str(p) for p in table.paths)} has "
                         f"{table.num_rows} rows of {table.cols}")
    weight = original.weight
    device = weight.device if weight.device.type != "meta" else torch.device("cpu")
    kwargs = dict(padding_idx=original.padding_idx, device=device, process_group=process_group,
                  round_scale=round_scale)
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


def _family(key: str) -> str | None:
    """The shard family prefix of ``<prefix>.shard_{i}.weight``, else None."""
    match = SHARD_NAME.match(key)
    return match["prefix"] if match else None


class _Keys:
    """Which checkpoint tensors hold a module's weight: the keys that
    transformers' loader would rename to ``<name>.weight`` (with the model's
    weight conversions: a Qwen4Exp shard family, base-model prefixes), or,
    for a model that is not a transformers model, ``<name>.weight`` and
    ``<name>.shard_{i}.weight`` as they are."""

    def __init__(self, model: nn.Module, entries: dict[str, TensorEntry], files: list[Path],
                 key_mapping):
        self.model = model
        self.entries = entries
        self.files = files
        self.prefix = getattr(model, "base_model_prefix", "") or ""
        self.key_mapping = key_mapping
        # The model's keys before any module is swapped.
        self.state = set(model.state_dict())
        # {checkpoint key: the model key transformers loads it into}.
        self.renamed = self._rename_all()

    def _rename_all(self) -> dict[str, str]:
        try:
            from transformers import PreTrainedModel
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import (WeightConverter, WeightRenaming,
                                                         rename_source_key)
        except ImportError:
            return {key: key for key in self.entries}
        if not isinstance(self.model, PreTrainedModel):
            return {key: key for key in self.entries}
        mapping = get_model_conversion_mapping(self.model, self.key_mapping)
        renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
        converters = [m for m in mapping if isinstance(m, WeightConverter)]
        state = dict.fromkeys(self.state, True)
        renamed = {}
        for key in self.entries:
            new, _ = rename_source_key(key, renamings, converters, self.prefix, state)
            if new not in state and key in state:  # as the loader does
                new, _ = rename_source_key(key, [], [], self.prefix, state)
            renamed[key] = new
        return renamed

    def table_of(self, name: str) -> tuple[str, list[Path], set[str]]:
        """The tensor or shard family of module ``name``, the files to open
        it from, and the model keys the loader will report unexpected."""
        target = f"{name}.weight"
        keys = sorted(key for key, new in self.renamed.items() if new == target)
        if not keys:
            # Not a transformers model, or no conversion: the names as they are.
            keys = sorted(key for key in self.entries
                          if key == target or _family(key) == name)
        if not keys:
            raise ValueError(
                f"no table for {name!r} in {describe_files(self.files)}: looked for a tensor "
                f"{target!r} or a shard family '{name}.shard_{{i}}.weight' (after transformers' "
                f"key renaming, so also with or without the prefix {self.prefix!r}); the closest "
                f"of their {len(self.entries)} tensors: {closest_names(self.entries, target)}")
        prefixes = {_family(key) for key in keys}
        if len(keys) == 1 and None in prefixes:
            tensor, scale = keys[0], f"{keys[0]}_scale"
        elif None not in prefixes and len(prefixes) == 1:
            tensor = prefixes.pop()
            scale = f"{tensor}.weight_scale"
        else:
            raise ValueError(f"{name!r}: several checkpoint tensors load into {target!r} ({keys}), "
                             "neither one tensor nor one shard family")
        holding = [*keys, scale] if scale in self.entries else keys
        paths = list(dict.fromkeys(self.entries[key].path for key in holding))
        reported = {target, *(self.renamed.get(key, key) for key in holding)}
        return tensor, paths, reported

    def ignore_unexpected(self, keys: set[str]) -> None:
        """Adds the keys to the model's ``_keys_to_ignore_on_load_unexpected``
        (regexes searched in the reported keys), with or without the
        base-model prefix, so that transformers does not warn about them."""
        patterns = set()
        for key in keys:
            rest = key.removeprefix(f"{self.prefix}.") if self.prefix else key
            prefix = rf"(?:{re.escape(self.prefix)}\.)?" if self.prefix else ""
            patterns.add(rf"^{prefix}{re.escape(rest)}$")
        ignored = getattr(self.model, "_keys_to_ignore_on_load_unexpected", None) or set()
        self.model._keys_to_ignore_on_load_unexpected = (
            ignored | patterns if isinstance(ignored, set) else [*ignored, *sorted(patterns)])

    def refuse_tables_left(self, swapped: dict[str, tuple[DiskEmbedding, str]]) -> None:
        """A ValueError for the checkpoint's tables of offload="auto"'s kind
        (``AUTO_TABLES``) that transformers would load into the model (which
        has a parameter for them) but that no module of ``swapped`` serves:
        loaded, they would be read whole into memory."""
        served = {f"{name}.weight" for name in swapped}
        left: dict[str, str] = {}
        for key, target in self.renamed.items():
            table = _family(key) or key.removesuffix(".weight")
            if (table.rsplit(".", 1)[-1] in AUTO_TABLES and target in self.state
                    and target not in served):
                left.setdefault(table, target)
        if left:
            table, target = next(iter(left.items()))
            more = f" (and {len(left) - 1} more)" if len(left) > 1 else ""
            raise ValueError(
                f"ple: offload='auto' would leave the table {table!r}{more} of "
                f"{describe_files(self.files)} to be read into memory as {target!r}: no module "
                f"of {type(self.model).__name__} there is one that 'auto' serves (a Qwen4Exp "
                "n-gram module's ngram_embedding, an nn.Embedding named "
                "embed_tokens_per_layer); name the module in offload=[...] to serve it, or pass "
                "offload=[] to load it into memory")


def _report(found: dict[str, str], model: nn.Module, where: Path, asked) -> None:
    if not found:
        if asked == "auto":
            logger.warning("ple: %s has no table that offload='auto' serves (Qwen4Exp n-gram "
                           "tables, embed_tokens_per_layer) in %s; nothing was offloaded",
                           type(model).__name__, where)
        return
    served = tables(model)
    total = sum(served[name].num_rows * served[name].row_bytes for name in found if name in served)

    def source(name: str) -> str:
        table = served.get(name)
        shards = len(table.shard_rows) if table is not None else 1
        return found[name] if shards == 1 else f"{found[name]}.shard_{{0..{shards - 1}}}.weight"

    logger.info("ple: %d table%s (%.1f MiB) left in the files of %s and served by ple: %s",
                len(found), "" if len(found) == 1 else "s", total / 2**20, where,
                ", ".join(f"{name} <- {source(name)}" for name in found))
