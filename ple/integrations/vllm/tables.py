"""What every model class of the plugin does around its tables: finds the
checkpoint's files, opens the tables with the plugin's settings, keeps vLLM's
loader from reading them, keys vLLM's compile cache on them, says what it
served, and builds a module of vLLM's model as ple's while the model is
built (:func:`built_with`: vLLM offers no other way to build one module on
the meta device or as another class)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from vllm.logger import init_logger

from ple.layers.disk_embedding import DiskEmbedding
from ple.table import Table

from ..checkpoints import local_snapshot, safetensors_files
from .settings import Settings

# Under "vllm.": vLLM's handler prints it, in the process's own log lines.
logger = init_logger("vllm.plugins.ple")

# vLLM's load formats that read whole files (every tensor of a file, the
# tables' too), and its safetensors strategies that do.
WHOLE_FILE_FORMATS = ("fastsafetensors", "instanttensor")
WHOLE_FILE_STRATEGIES = ("eager", "prefetch")
# The load formats whose loader is vLLM's default one (the lazy safetensors
# iterator when told so) or loads nothing (dummy).
SERVED_FORMATS = ("auto", "hf", "safetensors", "dummy", *WHOLE_FILE_FORMATS)
# The key of vllm_config.additional_config that holds the tables' handles.
COMPILE_CACHE_KEY = "ple_tables"


def checkpoint_paths(vllm_config) -> list[Path]:
    """The safetensors files of the model vLLM serves: those of its local
    directory, or of its snapshot in huggingface_hub's cache (downloaded
    first unless HF_HUB_OFFLINE, as vLLM's loader would)."""
    from huggingface_hub import constants

    model_config = vllm_config.model_config
    directory = Path(model_config.model)
    if not directory.is_dir():
        directory = local_snapshot(model_config.model, revision=model_config.revision,
                                   cache_dir=vllm_config.load_config.download_dir or None,
                                   offline=constants.HF_HUB_OFFLINE)
    return safetensors_files(directory)


@contextmanager
def built_with(module, name: str, build: Callable) -> Iterator[None]:
    """While inside, vLLM's model files that build ``module.<name>`` (a class
    they look up in their module when they build a layer) call ``build``
    instead, with the same arguments and ``original`` (vLLM's class) as a
    keyword; vLLM's class is back afterwards, raised or not.  The one way
    ple changes what vLLM builds: the plugin's model classes wrap their
    ``__init__`` in it."""
    original = getattr(module, name)
    setattr(module, name, lambda *args, **kwargs: build(*args, original=original, **kwargs))
    try:
        yield
    finally:
        setattr(module, name, original)


def table_on_meta(module, prefix_end: str):
    """While a vLLM model is built inside, ``module`` (one of vLLM's model
    files) builds the ``VocabParallelEmbedding`` whose prefix ends with
    ``prefix_end`` on the meta device: ple serves that table, and vLLM's
    parameter would allocate the whole of it (on the GPU, on CUDA) for
    nothing."""

    def build(*args, original, prefix: str = "", **kwargs):
        with torch.device("meta") if prefix.endswith(prefix_end) else nullcontext():
            return original(*args, prefix=prefix, **kwargs)

    return built_with(module, "VocabParallelEmbedding", build)


def open_embedding(name: str, files: list[Path], tensor: str, shape: tuple[int, int],
                   vllm_config, asked: Settings) -> DiskEmbedding:
    """A DiskEmbedding over ``tensor`` of ``files``, in the model's dtype on
    its device, with the plugin's gather settings and tiers; ``shape``: the
    module's (rows, cols), which the table must have."""
    table = Table.from_safetensors(files, tensor, asked.gather)
    try:
        if (table.num_rows, table.cols) != shape:
            raise ValueError(f"ple: {name} is an embedding of {shape[0]} x {shape[1]}, but its "
                             f"table {table.name!r} in {', '.join(map(str, table.paths))} has "
                             f"{table.num_rows} rows of {table.cols}")
        device = torch.device(vllm_config.device_config.device)
        module = DiskEmbedding(table, vllm_config.model_config.dtype, device=device)
        place_tiers(module, vllm_config, asked)
    except BaseException:
        table.close()
        raise
    return module


def place_tiers(module, vllm_config, asked: Settings) -> None:
    """Keeps the first rows of ``module`` (a ple layer with ``place``) in the
    tiers the plugin's settings ask for: device rows on the model's GPU."""
    if asked.host_rows or asked.device_rows:
        device = torch.device(vllm_config.device_config.device)
        module.place(device_rows=asked.device_rows, host_rows=asked.host_rows,
                     device=device if device.type == "cuda" else None)


def keep_loading_lazy(load_config) -> None:
    """Makes vLLM's loader hand the checkpoint's tensors over memory-mapped,
    so that the tables' tensors, which the model's ``load_weights`` skips, are
    never read: its safetensors iterator with the lazy strategy (its default
    strategy prefetches whole files on network filesystems; "eager" and
    "prefetch" read whole files, as do the multithreaded loader and the
    fastsafetensors and instanttensor formats).  Called as the model is
    built, before vLLM's loader iterates the weights (it reads its
    load_config then)."""
    if load_config.load_format not in SERVED_FORMATS:
        raise ValueError(f"ple serves tables from safetensors checkpoints through vLLM's default "
                         f"loader; load_format={load_config.load_format!r} is not supported "
                         f"(use one of {SERVED_FORMATS})")
    if load_config.load_format in WHOLE_FILE_FORMATS:
        logger.warning("ple: load_format=%r reads whole files, the tables' too: loading with "
                       "'safetensors' instead", load_config.load_format)
        load_config.load_format = "safetensors"
    if load_config.safetensors_load_strategy in WHOLE_FILE_STRATEGIES:
        logger.warning("ple: safetensors_load_strategy=%r reads whole files, the tables' too: "
                       "loading with 'lazy' instead", load_config.safetensors_load_strategy)
    load_config.safetensors_load_strategy = "lazy"
    extra = load_config.model_loader_extra_config
    if isinstance(extra, dict) and extra.get("enable_multithread_load"):
        logger.warning("ple: the multithreaded loader reads whole files, the tables' too: "
                       "loading on one thread instead")
        extra["enable_multithread_load"] = False


def key_compile_cache(vllm_config, tables: dict[str, Table]) -> None:
    """Adds the tables' handles to vLLM's compile cache key.  A compiled
    graph holds the handle of each table it gathers from, a digest of the
    files' identity (device, inode, size, mtime) that any process resolves to
    the same files' table, in whatever order its tables opened; a graph of
    other files (a checkpoint rewritten in place) would find no table and
    raise.  vLLM's key covers the model's path, not its files' identity, so
    ple adds the handles to ``additional_config``, which the key hashes:
    such a graph is compiled anew instead."""
    extra = vllm_config.additional_config
    if not isinstance(extra, dict):
        logger.warning("ple: vllm_config.additional_config is a %s, not a dict: vLLM's compile "
                       "cache is not keyed on the tables' files", type(extra).__name__)
        return
    extra[COMPILE_CACHE_KEY] = {name: table.handle for name, table in sorted(tables.items())}


def report(served: dict[str, tuple[torch.nn.Module, str]], in_memory_bytes: dict[str, int]) -> None:
    """One log line per table served: the module, its tensor and files, and
    the memory the module's parameter would have held."""
    for name, (module, tensor) in served.items():
        table = module.table
        files = _files(table.paths)
        logger.info("ple: %s <- %s (%d x %d %s in %s) served from the checkpoint's files: "
                    "%s of memory saved", name, tensor, table.num_rows, table.cols,
                    table.format, files, _size(in_memory_bytes[name]))


def _files(paths) -> str:
    """The names of a table's files, or their count and the first and last
    (a published n-gram table spans 128 files)."""
    names = [Path(p).name for p in dict.fromkeys(paths)]
    return ", ".join(names) if len(names) <= 3 else f"{len(names)} files, {names[0]} ... {names[-1]}"


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"
