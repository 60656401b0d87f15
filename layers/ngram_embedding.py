"""The hashed n-gram embedding of a PLE model, over a table on disk."""

from __future__ import annotations

import os

import torch

from ple.config import GatherConfig
from ple.formats import OUTPUT_DTYPES
from ple.table import Table

from .ngram_ids import NGramHashing
from .parallel import RowSplit, gather, prefetch


class NGramEmbedding(torch.nn.Module):
    """Each token's rows from its bigram and trigram hash heads, concatenated:
    ``forward(token_ids, seq_ids, context)`` gives ``[T, heads * table.cols]``
    in ``dtype`` on the ids' device.  The row ids are computed on that device
    inside the forward (no host sync), so the layer runs inside
    ``torch.compile(fullgraph=True)`` and CUDA graphs; before capturing a
    graph by hand, run the layer once on that device.

    ``process_group``: split the table's rows across its ranks
    (``ple.layers.parallel``); every rank returns the full embedding.
    """

    def __init__(self, table: Table, hashing: NGramHashing, dtype: torch.dtype = torch.bfloat16,
                 process_group=None):
        super().__init__()
        if dtype not in OUTPUT_DTYPES:
            raise TypeError(f"dtype must be one of {OUTPUT_DTYPES}, not {dtype}")
        needed = hashing.row_offset + hashing.rows
        if table.num_rows < needed:
            raise ValueError(
                f"table {table.name!r} has {table.num_rows} rows, but layer {hashing.layer_id}'s "
                f"{hashing.heads} hash heads need rows [{hashing.row_offset}, {needed})")
        self.table = table
        self.hashing = hashing
        self.dtype = dtype
        self.embedding_dim = hashing.heads * table.cols
        self.split = None if process_group is None else RowSplit.for_group(table.num_rows,
                                                                           process_group)

    @classmethod
    def from_safetensors(cls, checkpoint: str | os.PathLike, *, vocab_size: int, eos_id: int,
                         layer_id: int, base_size: int, tensor: str = "ngram_embedding",
                         dtype: torch.dtype = torch.bfloat16, config: GatherConfig | None = None,
                         process_group=None, **hashing_args) -> "NGramEmbedding":
        """The layer over the shards ``<tensor>.shard_{i}.weight`` (with their
        ``<tensor>.weight_scale``) of a safetensors checkpoint: a directory, a
        file or a list of files.

        ``vocab_size``, ``eos_id``, ``layer_id`` and ``base_size`` are required:
        we do not know the reference model's values, so no defaults stand in for
        them.  ``hashing_args`` go to :class:`NGramHashing` (``seed``,
        ``bigram_heads``, ``trigram_heads``, ``pad_id``, ``row_offset``).
        """
        hashing = NGramHashing(vocab_size=vocab_size, eos_id=eos_id, layer_id=layer_id,
                               base_size=base_size, **hashing_args)
        return cls._opened(Table.from_safetensors(checkpoint, tensor, config), hashing, dtype,
                           process_group)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike, tensor: str, *, vocab_size: int, eos_id: int,
                  layer_id: int, base_size: int, dtype: torch.dtype = torch.bfloat16,
                  config: GatherConfig | None = None, process_group=None, **hashing_args
                  ) -> "NGramEmbedding":
        """The layer over the 2-D tensor ``tensor`` of a GGUF file; the other
        arguments as in :meth:`from_safetensors`."""
        hashing = NGramHashing(vocab_size=vocab_size, eos_id=eos_id, layer_id=layer_id,
                               base_size=base_size, **hashing_args)
        return cls._opened(Table.from_gguf(path, tensor, config), hashing, dtype, process_group)

    @classmethod
    def _opened(cls, table: Table, hashing: NGramHashing, dtype: torch.dtype, process_group
                ) -> "NGramEmbedding":
        try:
            return cls(table, hashing, dtype, process_group)
        except BaseException:
            table.close()
            raise

    def row_ids(self, token_ids: torch.Tensor, seq_ids: torch.Tensor | None = None,
                context: torch.Tensor | None = None) -> torch.Tensor:
        """The table rows of each token, ``[T, heads]`` int64 (``NGramHashing.row_ids``)."""
        return self.hashing.row_ids(token_ids, seq_ids, context)

    def forward(self, token_ids: torch.Tensor, seq_ids: torch.Tensor | None = None,
                context: torch.Tensor | None = None) -> torch.Tensor:
        """``token_ids`` ``[T]``: several requests back to back; ``seq_ids``
        ``[T]`` each token's request, ``context`` ``[R, 2]`` each request's
        ``(prev2, prev)`` from its previous step (see ``NGramHashing.row_ids``)."""
        rows = gather(self.table, self.row_ids(token_ids, seq_ids, context), self.dtype,
                      self.split)
        return rows.reshape(token_ids.shape[0], self.embedding_dim)

    def prefetch(self, token_ids: torch.Tensor, seq_ids: torch.Tensor | None = None,
                 context: torch.Tensor | None = None) -> None:
        """Starts reading the rows of a later ``forward`` with these arguments
        (CPU tensors, equal to the ones that forward gets), so that its gather
        takes them instead of reading them itself."""
        prefetch(self.table, self.row_ids(token_ids, seq_ids, context), self.split)

    def extra_repr(self) -> str:
        split = "" if self.split is None else f", {self.split}"
        return (f"table={self.table.name!r}, layer_id={self.hashing.layer_id}, "
                f"heads={self.hashing.heads}, embedding_dim={self.embedding_dim}, "
                f"dtype={self.dtype}{split}")
