"""A token embedding whose table is one tensor of a GGUF file, kept packed."""

from __future__ import annotations

import os

import torch

from ple.config import GatherConfig
from ple.formats import OUTPUT_DTYPES
from ple.table import Table

from .lookahead import LooksAhead
from .parallel import PlacesServedRows, RowSplit, gather, layer_ids


class PackedGGUFEmbedding(LooksAhead, PlacesServedRows, torch.nn.Module):
    """``forward(token_ids)`` gives ``[*token_ids.shape, cols]`` in ``dtype`` on
    the ids' device.  The table stays in its file in its GGUF format (Q8_0,
    Q4_K, ...), as do the host tiers of ``layer.table.place(...)``; only the
    rows a step gathers are decoded.

    ``process_group``: split the table's rows across its ranks
    (``ple.layers.parallel``); every rank returns the full embedding, and
    :meth:`place` keeps the rank's own rows in its tiers.
    """

    def __init__(self, path: str | os.PathLike, tensor: str = "token_embd.weight",
                 dtype: torch.dtype = torch.bfloat16, config: GatherConfig | None = None,
                 process_group=None):
        super().__init__()
        if dtype not in OUTPUT_DTYPES:
            raise TypeError(f"dtype must be one of {OUTPUT_DTYPES}, not {dtype}")
        table = Table.from_gguf(path, tensor, config)
        try:
            self.split = None if process_group is None else RowSplit.for_group(table.num_rows,
                                                                               process_group)
        except BaseException:
            table.close()
            raise
        self.table = table
        self.dtype = dtype
        self.num_embeddings = table.num_rows
        self.embedding_dim = table.cols

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return gather(self.table, layer_ids(token_ids), self.dtype, self.split,
                      owner=self.prefetch_owner)

    def row_ids(self, token_ids: torch.Tensor, seq_ids: torch.Tensor | None = None,
                context: torch.Tensor | None = None) -> torch.Tensor:
        """The table rows a forward of ``token_ids`` gathers: the ids
        themselves, as int64 of their shape and device (``seq_ids`` and
        ``context`` change nothing: see ``DiskEmbedding.row_ids``)."""
        return layer_ids(token_ids).to(torch.int64)

    def extra_repr(self) -> str:
        split = "" if self.split is None else f", {self.split}"
        return (f"table={self.table.name!r} ({self.table.format}), num_embeddings="
                f"{self.num_embeddings}, embedding_dim={self.embedding_dim}, dtype={self.dtype}"
                f"{split}")
