"""The hashed n-gram embedding of a PLE model, over a table on disk."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import safe_open

from ple.config import GatherConfig
from ple.formats import OUTPUT_DTYPES
from ple.gguf_header import read_gguf_header
from ple.safetensors_tables import (PathsLike, find_table, missing_table, read_entries,
                                    resolve_paths)
from ple.table import Table

from .ngram_ids import NGramConstants, NGramHashing, decoder_layer
from .lookahead import LooksAhead
from .parallel import PlacesServedRows, RowSplit, gather, layer_ids, served_rows

# The reference checkpoint's table, and where transformers' save_pretrained
# puts the table of decoder layer {layer} (a published multimodal checkpoint
# under model.language_model.layers: ple.safetensors_tables.layout_names); the
# layer's constants are buffers next to it.
REFERENCE_TABLE = "ngram_embedding"
TRANSFORMERS_TABLE = "model.layers.{layer}.ple.ple_embedding.ngram_embedding"
CONSTANT_BUFFERS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")
INTEGER_DTYPES = ("I64", "I32", "U64", "U32")
GGUF_CONSTANTS = {"layer_multipliers": "qwen4exp.ple.layer_multipliers",
                  "head_vocab_sizes": "qwen4exp.ple.head_vocab_sizes",
                  "head_offsets": "qwen4exp.ple.head_offsets"}
GGUF_EOS = "qwen4exp.ple.eos_token_id"
# The PLE layers' decoder indices: its length is the number of layers whose
# values the arrays above hold back to back.
GGUF_LAYERS = "qwen4exp.ple.layers"


class NGramEmbedding(LooksAhead, PlacesServedRows, torch.nn.Module):
    """Each token's rows from its hash heads (the 2-gram heads, then the
    3-gram heads, ...), concatenated: ``forward(token_ids, seq_ids, context)``
    gives ``[T, heads * table.cols]`` in ``dtype`` on the ids' device.  The
    row ids are computed on that device inside the forward (no host sync), so
    the layer runs inside ``torch.compile(fullgraph=True)`` and CUDA graphs;
    before capturing a graph by hand, run the layer once on that device.

    ``process_group``: split the table's rows across its ranks
    (``ple.layers.parallel``); every rank returns the full embedding, and
    :meth:`place` keeps the rank's own rows in its tiers.

    ``round_scale`` (``torch.ops.ple.disk_gather``'s argument) chooses the
    arithmetic of a scaled (FP8) table.  True, the default, is the reference
    model's: ``values.to(dtype) * scale.to(dtype)``, as transformers'
    ``FP8Embedding`` computes once its loader has cast ``weight_scale`` to the
    model's dtype, and as vLLM's Qwen4Exp does; False is the float32 product
    ``(values.to(float32) * scale).to(dtype)``.  They differ where the scale
    is not a value of ``dtype`` (never in float32).
    """

    def __init__(self, table: Table, hashing: NGramHashing, dtype: torch.dtype = torch.bfloat16,
                 process_group=None, round_scale: bool = True):
        super().__init__()
        if dtype not in OUTPUT_DTYPES:
            raise TypeError(f"dtype must be one of {OUTPUT_DTYPES}, not {dtype}")
        needed = hashing.row_offset + hashing.rows
        if table.num_rows < needed:
            raise ValueError(
                f"table {table.name!r} has {table.num_rows} rows, but PLE layer "
                f"{hashing.ple_layer_index}'s {hashing.heads} hash heads need rows "
                f"[{hashing.row_offset}, {needed})")
        self.table = table
        self.hashing = hashing
        self.dtype = dtype
        self.round_scale = round_scale
        self.embedding_dim = hashing.heads * table.cols
        self.split = None if process_group is None else RowSplit.for_group(table.num_rows,
                                                                           process_group)

    @classmethod
    def from_safetensors(cls, checkpoint: PathsLike, tensor: str | None = None, *,
                         model_config=None, ple_layer_index: int = 0,
                         dtype: torch.dtype = torch.bfloat16, config: GatherConfig | None = None,
                         process_group=None, round_scale: bool = True, **hashing_args
                         ) -> "NGramEmbedding":
        """The layer over the shards ``<tensor>.shard_{i}.weight`` (with their
        ``<tensor>.weight_scale``), or the 2-D tensor ``<tensor>``, of a
        safetensors checkpoint: a directory, a file or a list of files.

        The hashing comes from ``model_config`` (a transformers
        ``Qwen4ExpTextConfig`` or a dict of its keys; see
        ``NGramHashing.from_config``) or from ``hashing_args`` (``vocab_size``,
        ``eos_id``, and the other arguments of :class:`NGramHashing`).  The
        checkpoint's own constants, buffers ``layer_multipliers``,
        ``ngram_heads_vocab_sizes`` and ``ngram_heads_offsets`` next to the
        table (as transformers saves them), replace the derived ones.
        ``tensor`` defaults to transformers' name for PLE layer
        ``ple_layer_index`` when ``model_config`` is given (a text config, or
        a multimodal one whose ``text_config`` is used) and the checkpoint
        has it, else to ``ngram_embedding``.  A name ``model.x`` is found as
        ``model.language_model.x`` too (the published multimodal layout), and
        the other way round.  ``config`` is the table's
        :class:`ple.GatherConfig`.
        """
        files = resolve_paths(checkpoint)
        entries = read_entries(files)
        tried = [tensor] if tensor is not None else [REFERENCE_TABLE]
        if tensor is None and model_config is not None:
            named = TRANSFORMERS_TABLE.format(layer=decoder_layer(model_config, ple_layer_index))
            tried = [named, f"{named}.weight", REFERENCE_TABLE]
        tensor = next((found for name in tried if (found := find_table(entries, name))), None)
        if tensor is None:
            raise missing_table(entries, files, *tried)
        constants = _safetensors_constants(entries, tensor)
        hashing = _hashing(model_config, ple_layer_index, constants, hashing_args)
        return cls._opened(Table.from_safetensors(files, tensor, config), hashing, dtype,
                           process_group, round_scale)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike, tensor: str, *, model_config=None,
                  ple_layer_index: int = 0, dtype: torch.dtype = torch.bfloat16,
                  config: GatherConfig | None = None, process_group=None,
                  round_scale: bool = True, **hashing_args) -> "NGramEmbedding":
        """The layer over the 2-D tensor ``tensor`` of a GGUF file; the file's
        ``qwen4exp.ple.*`` constants (multipliers, head sizes and offsets,
        EOS) replace the derived ones.  The other arguments as in
        :meth:`from_safetensors`."""
        path = Path(path)
        header = read_gguf_header(path, keys=(GGUF_LAYERS, GGUF_EOS, *GGUF_CONSTANTS.values()))
        table = Table._from_gguf_header(path, header, tensor, config)
        try:
            constants, eos = _gguf_constants(path, header.values, ple_layer_index)
            if eos is not None:
                hashing_args["eos_id"] = eos
            hashing = _hashing(model_config, ple_layer_index, constants, hashing_args)
        except BaseException:
            table.close()
            raise
        return cls._opened(table, hashing, dtype, process_group, round_scale)

    @classmethod
    def _opened(cls, table: Table, hashing: NGramHashing, dtype: torch.dtype, process_group,
                round_scale: bool) -> "NGramEmbedding":
        try:
            return cls(table, hashing, dtype, process_group, round_scale)
        except BaseException:
            table.close()
            raise

    # row_ids gives [T, heads]: the tokens lie along the first dimension.
    TOKEN_DIM = -2

    def row_ids(self, token_ids: torch.Tensor, seq_ids: torch.Tensor | None = None,
                context: torch.Tensor | None = None) -> torch.Tensor:
        """The table rows a forward of these arguments gathers: each token's,
        ``[T, heads]`` int64 on the tokens' device (``NGramHashing.row_ids``;
        a planner passes CPU tensors)."""
        return self._hashed_ids(token_ids, seq_ids, context)

    def forward(self, token_ids: torch.Tensor, seq_ids: torch.Tensor | None = None,
                context: torch.Tensor | None = None) -> torch.Tensor:
        """``token_ids`` ``[T]``: several requests back to back; ``seq_ids``
        ``[T]`` each token's request, ``context`` ``[R, ngram_size - 1]`` each
        request's last tokens before this step, oldest first (see
        ``NGramHashing.row_ids``)."""
        ids = self._hashed_ids(token_ids, seq_ids, context)
        rows = gather(self.table, ids, self.dtype, self.split, self.round_scale,
                      owner=self.prefetch_owner)
        return rows.reshape(ids.shape[0], self.embedding_dim)

    def _hashed_ids(self, token_ids, seq_ids, context) -> torch.Tensor:
        """The rows of the tokens, ``[T, heads]`` int64 on their device."""
        seq_ids = None if seq_ids is None else layer_ids(seq_ids)
        context = None if context is None else layer_ids(context)
        return self.hashing.row_ids(layer_ids(token_ids), seq_ids, context)

    @property
    def served_rows(self) -> tuple[int, int]:
        """``(start, stop)``: the table rows this layer gathers in this
        process, its hash heads' rows (of them this rank's, with a split)."""
        return served_rows(self.split, self.hashing.row_offset,
                           self.hashing.row_offset + self.hashing.rows)

    def extra_repr(self) -> str:
        split = "" if self.split is None else f", {self.split}"
        return (f"table={self.table.name!r}, ple_layer_index={self.hashing.ple_layer_index}, "
                f"heads={self.hashing.heads}, embedding_dim={self.embedding_dim}, "
                f"dtype={self.dtype}, round_scale={self.round_scale}{split}")


def _hashing(model_config, ple_layer_index: int, constants: NGramConstants, hashing_args: dict
             ) -> NGramHashing:
    if model_config is not None:
        return NGramHashing.from_config(model_config, ple_layer_index, constants=constants,
                                        **hashing_args)
    missing = [name for name in ("vocab_size", "eos_id") if name not in hashing_args]
    if missing:
        raise TypeError(f"the hashing needs model_config, or vocab_size and eos_id (missing: "
                        f"{', '.join(missing)})")
    return NGramHashing(ple_layer_index=ple_layer_index, constants=constants, **hashing_args)


def _safetensors_constants(entries, table: str) -> NGramConstants:
    """The buffers transformers saves beside the table ``<parent>.ngram_embedding``
    (a shard family, or one tensor ``<parent>.ngram_embedding.weight``)."""
    parent = table.removesuffix(".weight").rpartition(".")[0]
    found = {}
    for buffer in CONSTANT_BUFFERS:
        entry = entries.get(f"{parent}.{buffer}" if parent else buffer)
        if entry is None:
            continue
        if entry.dtype not in INTEGER_DTYPES or len(entry.shape) != 1:
            raise ValueError(f"{entry.path}: n-gram constant {entry.name!r} must be a 1-D integer "
                             f"tensor, not {entry.dtype} {list(entry.shape)}")
        with safe_open(str(entry.path), "pt") as f:
            found[buffer] = f.get_tensor(entry.name).tolist()
    return NGramConstants.coerce(found)


def _gguf_constants(path: Path, values: dict, ple_layer_index: int
                    ) -> tuple[NGramConstants, int | None]:
    """The constants of PLE layer ``ple_layer_index`` among a GGUF file's
    key-values ``values``, and its EOS token.  An array holds the layers'
    values back to back."""
    layers = values.get(GGUF_LAYERS)
    num_layers = len(layers) if isinstance(layers, list) else 1
    found = {}
    for name, key in GGUF_CONSTANTS.items():
        if key not in values:
            continue
        field = values[key] if isinstance(values[key], list) else [values[key]]
        if len(field) % num_layers:
            raise ValueError(f"{path}: {key} has {len(field)} values, not a whole number for "
                             f"{num_layers} PLE layers")
        per_layer = len(field) // num_layers
        if ple_layer_index >= num_layers:
            raise ValueError(f"{path}: {key} holds {num_layers} PLE layers' values, so there is no "
                             f"ple_layer_index {ple_layer_index}")
        found[name] = field[ple_layer_index * per_layer:(ple_layer_index + 1) * per_layer]
    return NGramConstants.coerce(found), values.get(GGUF_EOS)
