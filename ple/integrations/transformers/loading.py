"""Loading a transformers model with its tables served by ple: the
checkpoint's files (a local folder, or a snapshot in huggingface_hub's
cache), the class transformers would build (auto classes resolved by
transformers' own mapping), a loading subclass whose ``__init__`` swaps the
offloaded modules in before transformers reads a weight, and a log line of
what is served.  transformers' loader reports the tables' tensors
"unexpected" and never reads them."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path

from torch import nn

from ple.config import GatherConfig
from ple.layers.disk_embedding import DiskEmbedding
from ple.layers.lookahead import DEFAULT_MAX_BYTES as DEFAULT_LOOKAHEAD_BYTES
from ple.layers.lookahead import lookahead_mib as checked_lookahead_mib
from ple.safetensors_tables import read_checkpoint_entries
from ple.table import Table

from ..checkpoints import local_snapshot, safetensors_files
from .generate import serve
from .keys import CheckpointKeys
from .modules import replace_with_disk_embeddings, tables

logger = logging.getLogger(__name__)

# transformers' from_pretrained arguments that say where a hub checkpoint is;
# ple takes them to find the snapshot in huggingface_hub's cache, and gives
# transformers that snapshot's folder.
HUB_ARGUMENTS = ("revision", "cache_dir", "token", "force_download", "local_files_only")


def from_pretrained(model_class, path: str | os.PathLike, *, offload: str | Iterable[str] = "auto",
                    gather_config: GatherConfig | None = None, process_group=None,
                    round_scale: bool = True,
                    lookahead_mib: int = DEFAULT_LOOKAHEAD_BYTES >> 20,
                    table_file: str | os.PathLike | None = None, **kwargs):
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
    ``ple.integrations.transformers.generate``).

    ``table_file``: a GGUF file holding a quantized copy of the one table
    served (``ple-quantize-table`` writes one): its rows are gathered in
    place of the checkpoint's, decoded to the model's dtype; the state dict,
    and so a save, keeps the checkpoint's own table."""
    _lookahead_bytes(lookahead_mib)  # a bad value raises before anything is read
    if table_file is not None and not Path(table_file).is_file():
        raise FileNotFoundError(f"table_file={table_file}: no such file")
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
    files = safetensors_files(directory, kwargs.get("variant"))
    entries = read_checkpoint_entries(files)
    opened: list[DiskEmbedding] = []
    found: dict[str, str] = {}

    def swap_in(model):
        where = CheckpointKeys(model, entries, files, kwargs.get("key_mapping"))
        swapped = replace_with_disk_embeddings(model, where, offload, gather_config,
                                               process_group, round_scale, table_file)
        for module, _ in swapped.values():
            # transformers' loader would fill the tensors of the state dict.
            module.hold_table_in_state_dict(False)
            opened.append(module)
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
    for module in opened:
        module.reset_scale()  # the loader replaced their non-persistent buffers with empty ones
        module.hold_table_in_state_dict()
    model.ple_offloaded = found
    if found:
        serve(model, _lookahead_bytes(lookahead_mib))
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
        files = safetensors_files(Path(path))
    else:
        items = [path] if isinstance(path, (str, os.PathLike)) else list(path)
        files = [Path(p) for p in items]
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(f"{file}: no such checkpoint file")
    where = CheckpointKeys(model, read_checkpoint_entries(files), files, key_mapping)
    swapped = replace_with_disk_embeddings(model, where, names, gather_config, process_group,
                                           round_scale)
    offloaded = dict(getattr(model, "ple_offloaded", None) or {})
    offloaded.update({name: tensor for name, (_, tensor) in swapped.items()})
    model.ple_offloaded = offloaded
    if offloaded:
        serve(model, _lookahead_bytes(lookahead_mib))
    _report({name: tensor for name, (_, tensor) in swapped.items()}, model, files[0].parent, names)
    return {name: module.table for name, (module, _) in swapped.items()}


def _local_checkpoint(path: str | os.PathLike, kwargs: dict) -> str | os.PathLike:
    """``path`` when it is a local directory, else the folder of the snapshot
    of the hub repo ``path`` in huggingface_hub's cache; the hub arguments
    are taken out of ``kwargs``, as that folder is what transformers then
    loads.  Nothing is downloaded unless ``local_files_only=False``."""
    if Path(path).is_dir():
        return path
    hub = {name: kwargs.pop(name) for name in HUB_ARGUMENTS if name in kwargs}
    offline = hub.pop("local_files_only", True)
    try:
        return local_snapshot(str(path), subfolder=kwargs.get("subfolder") or "",
                              offline=offline, **hub)
    except FileNotFoundError as error:
        if not offline or "no snapshot" not in str(error):
            raise
        raise FileNotFoundError(f"{error}, or pass local_files_only=False to let "
                                "from_pretrained download it") from None


def _lookahead_bytes(lookahead_mib: int) -> int:
    return checked_lookahead_mib(lookahead_mib, "lookahead_mib") << 20



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
        return served[name].tensor_names if name in served else found[name]

    logger.info("ple: %d table%s (%.1f MiB) left in the files of %s and served by ple: %s",
                len(found), "" if len(found) == 1 else "s", total / 2**20, where,
                ", ".join(f"{name} <- {source(name)}" for name in found))
