"""A token embedding whose table is one tensor of a GGUF file, kept packed."""

from __future__ import annotations

import os

import torch

from ple.config import GatherConfig
from ple.formats import OUTPUT_DTYPES
from ple.table import Table

from .lookahead import DEFAULT_MAX_BYTES, Lookahead, LooksAhead, chunk_ids
from .parallel import PlacesServedRows, RowSplit, gather, prefetch


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
        if self._lookahead is None:
            return self._rows(token_ids)
        return self._gather_planned(self._rows, token_ids)

    def _rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        return gather(self.table, token_ids, self.dtype, self.split)

    def prefetch(self, token_ids: torch.Tensor) -> None:
        """Starts reading the rows of a later ``forward`` of ids equal to these
        (on the CPU), so that its gather takes them instead of reading them itself."""
        prefetch(self.table, token_ids, self.split)

    def lookahead(self, token_ids: torch.Tensor, chunk_size: int,
                  max_bytes: int = DEFAULT_MAX_BYTES) -> Lookahead | None:
        """The next forwards are of ``token_ids.split(chunk_size, dim=-1)``, in
        order: their rows are read ahead, at most ``max_bytes`` beyond the
        chunk being gathered (``ple.layers.lookahead``).
        Returns the plan (None: no chunks), for ``end_lookahead(plan)``."""
        return self._look_ahead(chunk_ids(token_ids, chunk_size, dim=-1), max_bytes)

    def extra_repr(self) -> str:
        split = "" if self.split is None else f", {self.split}"
        return (f"table={self.table.name!r} ({self.table.format}), num_embeddings="
                f"{self.num_embeddings}, embedding_dim={self.embedding_dim}, dtype={self.dtype}"
                f"{split}")
