"""An ``nn.Embedding`` lookup whose table stays in its checkpoint files."""

from __future__ import annotations

import os

import torch

from ple.config import GatherConfig
from ple.formats import OUTPUT_DTYPES
from ple.safetensors_tables import PathsLike
from ple.table import Table

from .lookahead import LooksAhead
from .parallel import PlacesServedRows, RowSplit, gather, layer_ids

# disk_gather's dtypes, and float64, which the rows are widened to from float32.
DTYPES = (*OUTPUT_DTYPES, torch.float64)


class DiskEmbedding(LooksAhead, PlacesServedRows, torch.nn.Module):
    """A drop-in for the lookup of an ``nn.Embedding``: ``forward(ids)`` is
    ``torch.nn.functional.embedding(ids, W)`` bit for bit, ``W`` being the
    table's values (the stored tensor for F32, F16 and BF16 rows; the decoded
    values, times the scale, for FP8, U8, I8 and GGUF rows) cast to ``dtype``
    by torch's own conversion.  The rows are gathered from the files by
    ``torch.ops.ple.disk_gather`` on the ids' device, so the module runs on
    CPU ids and on CUDA ids alike, and inside ``torch.compile``.

    It has no parameters.  ``dtype`` (default: the table's, ``table.dtype``)
    follows the module's casts as a weight would: ``.to(torch.bfloat16)``,
    ``.half()``, ``.float()`` and ``.double()`` change it, ``.to("cuda")``
    does not; it is kept as the dtype of an empty non-persistent buffer,
    which also moves with ``.to(device)``.  float64 rows are gathered as
    float32 and widened (exactly: every table's values are float32 values).

    ``round_scale`` chooses the arithmetic of scaled rows (FP8, U8, I8;
    ``torch.ops.ple.disk_gather``'s argument).  False, the default, is the
    lookup above: ``W`` is the float32 product value x scale, cast to
    ``dtype``, as for an ``nn.Embedding`` over the dequantized table.  True
    is the arithmetic of transformers' ``FP8Embedding`` (the transformers
    integration's modules take it): the module holds the scale as that
    module holds its ``weight_scale``, in a non-persistent buffer
    ``weight_scale`` of ``dtype`` (the table's scale cast to ``dtype``, as
    the loader casts the checkpoint's float32 scale), which every cast of
    the module casts as it casts the model's, and the rows are
    ``values.to(dtype) * weight_scale``.  So after ``.to(torch.float16)`` of
    a bfloat16 module the scale is the bfloat16 scale rounded again to
    float16, and after ``.float()`` the bfloat16 scale, as in the model.  The
    two arithmetics differ where the scale is not a value of ``dtype``.

    ``process_group``: split the table's rows across its ranks
    (``ple.layers.parallel``); every rank returns the full rows, and
    :meth:`place` keeps the rank's own rows in its tiers.

    Its state dict holds the table as the checkpoint holds it, so that a
    model saved by any route (``torch.save`` or ``safetensors`` of its
    ``state_dict()``, transformers' ``save_pretrained``, accelerate, a
    Trainer) is whole: ``weight`` (or a shard family's ``shard_{i}.weight``)
    as CPU tensors over the very files the table maps
    (``Table.checkpoint_tensors``: nothing is read until they are saved, and
    then through the page cache, never whole in memory), and ``weight_scale``
    for a scaled table (the module's buffer with ``round_scale``, else the
    checkpoint's scale tensor).  ``load_state_dict`` takes those entries
    when they equal the table (a state dict of this module, or of the
    reference module over the same values) and refuses other values: the
    rows stay in their files.  A GGUF table keeps no tensor in the state
    dict (its blocks are no torch dtype), unless ``checkpoint`` names the
    safetensors table it is a quantized copy of, whose tensors the state
    dict holds instead (a saved model is then the original); nor does any
    table while
    :meth:`hold_table_in_state_dict` says not to (a loader that fills the
    state dict's tensors from the checkpoint, as transformers' does, must
    not see them).

    The module owns ``table``: :meth:`close` closes it (so does leaving a
    ``with`` block of the module).  Inference only: the
    table has no gradient, and ``max_norm`` is not supported.
    """

    def __init__(self, table: Table, dtype: torch.dtype | None = None, *,
                 padding_idx: int | None = None, device: torch.device | str | None = None,
                 process_group=None, round_scale: bool = False, checkpoint: Table | None = None):
        super().__init__()
        dtype = table.dtype if dtype is None else dtype
        if dtype not in DTYPES:
            raise TypeError(f"dtype must be one of {DTYPES}, not {dtype}")
        self.split = None if process_group is None else RowSplit.for_group(table.num_rows,
                                                                           process_group)
        self.table = table
        self._round_scale = round_scale
        self.num_embeddings = table.num_rows
        self.embedding_dim = table.cols
        # Only recorded, as nn.Embedding's: it changes gradients, never the lookup.
        self.padding_idx = padding_idx
        # An explicit device: built under `with torch.device("meta")` (as
        # transformers builds models), a buffer of no elements is still real.
        self.register_buffer("dtype_tracker", torch.empty(0, dtype=dtype, device=device or "cpu"),
                             persistent=False)
        self._meta_weight: torch.Tensor | None = None
        # The table whose checkpoint tensors the state dict holds: the
        # original of a quantized copy that `table` is.
        self.checkpoint = table if checkpoint is None else checkpoint
        self._table_in_state_dict = self.checkpoint.row_format.safetensors_dtype is not None
        # weight_scale's value, read when a cast changes it: the gathers take
        # it as a number, and reading a CUDA buffer in a forward would sync.
        self._scale_value: float | None = None
        if round_scale and table.row_format.scaled:
            # [1], the shape of FP8Embedding's weight_scale.
            self.register_buffer("weight_scale",
                                 torch.empty(1, dtype=dtype, device=device or "cpu"),
                                 persistent=False)
            self.reset_scale()

    @classmethod
    def from_safetensors(cls, paths: PathsLike, tensor: str | None = None, *,
                         dtype: torch.dtype | None = None, config: GatherConfig | None = None,
                         scale: float | None = None, **kwargs) -> "DiskEmbedding":
        """Opens ``tensor`` (a 2-D tensor, or a shard family prefix) of
        ``paths`` as with ``ple.Table.from_safetensors`` (``model.x`` is found
        as ``model.language_model.x`` too, as a published multimodal
        checkpoint names it, and the other way round); the table is closed
        again if the module cannot be made."""
        table = Table.from_safetensors(paths, tensor, config, scale=scale)
        return cls._owning(table, dtype, kwargs)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike, tensor: str, *, dtype: torch.dtype | None = None,
                  config: GatherConfig | None = None, **kwargs) -> "DiskEmbedding":
        """Opens the 2-D tensor ``tensor`` of a GGUF file, kept packed in its
        format; the table is closed again if the module cannot be made."""
        table = Table.from_gguf(path, tensor, config)
        return cls._owning(table, dtype, kwargs)

    @classmethod
    def _owning(cls, table: Table, dtype, kwargs) -> "DiskEmbedding":
        try:
            return cls(table, dtype, **kwargs)
        except BaseException:
            table.close()
            raise

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the rows ``forward`` returns."""
        return self.dtype_tracker.dtype

    @property
    def round_scale(self) -> bool:
        """The arithmetic of scaled rows, chosen when the module is made (it
        decides whether the module holds a ``weight_scale``)."""
        return self._round_scale

    @torch.no_grad()
    def reset_scale(self) -> None:
        """Sets ``weight_scale`` (with ``round_scale``, over a scaled table) to
        the table's scale cast to ``dtype``, as a loader casts a checkpoint's
        float32 scale: transformers' loader replaces every non-persistent
        buffer with an empty one."""
        if self._holds_scale():
            self.weight_scale.copy_(torch.tensor(self.table.scale, dtype=torch.float32,
                                                 device=self.weight_scale.device))
            self._read_scale()

    def _holds_scale(self) -> bool:
        return "weight_scale" in self._buffers

    def _read_scale(self) -> None:
        if not self.weight_scale.is_meta:
            self._scale_value = float(self.weight_scale)

    def _apply(self, fn, recurse: bool = True):
        # Every cast and move of a module (.to, .half, .float, .bfloat16,
        # .double, .cuda, to_empty) runs _apply.
        super()._apply(fn, recurse)
        if self._holds_scale():
            self._follow_scale()
        return self

    @torch.no_grad()
    def _follow_scale(self) -> None:
        """Gives ``weight_scale`` the value it had, cast to its dtype now: what
        a cast of it gives, and what a module moved to the meta device and
        back, or emptied by ``to_empty``, would otherwise have lost."""
        if self._scale_value is None or self.weight_scale.is_meta:
            return
        self.weight_scale.fill_(torch.tensor(self._scale_value, dtype=self.weight_scale.dtype))
        self._read_scale()

    def hold_table_in_state_dict(self, hold: bool = True) -> None:
        """Whether ``state_dict()`` holds the table's checkpoint tensors (of a
        safetensors table; the default).  The transformers integration turns
        it off while transformers' loader runs, which would otherwise read
        the table into them."""
        self._table_in_state_dict = hold and self.checkpoint.row_format.safetensors_dtype is not None

    def _table_entries(self, prefix: str) -> dict[str, torch.Tensor]:
        """The state dict's entries of the table: its shards and its scale, by key."""
        shards, scale = self.checkpoint.checkpoint_tensors()
        if len(shards) == 1:
            entries = {f"{prefix}weight": next(iter(shards.values()))}
        else:
            entries = {f"{prefix}shard_{i}.weight": shard for i, shard in enumerate(shards.values())}
        if self._holds_scale():
            entries[f"{prefix}weight_scale"] = self.weight_scale
        elif scale:
            entries[f"{prefix}weight_scale"] = next(iter(scale.values()))
        return entries

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self._table_in_state_dict:
            for key, tensor in self._table_entries(prefix).items():
                destination[key] = tensor if keep_vars else tensor.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        if self.checkpoint.row_format.safetensors_dtype is None:
            return
        for key, ours in self._table_entries(prefix).items():
            if key not in state_dict:
                continue
            if key in unexpected_keys:
                unexpected_keys.remove(key)
            given = state_dict[key]
            if key == f"{prefix}weight_scale" and self._holds_scale():
                self._load_scale(given)
            elif not given.is_meta:
                differs = _first_difference(given, ours)
                if differs is not None:
                    error_msgs.append(
                        f"{key}: ple serves {self.checkpoint.name!r} from its files, and the state "
                        f"dict's values differ from them ({differs}); the rows of a served "
                        "table cannot be loaded")

    @torch.no_grad()
    def _load_scale(self, given: torch.Tensor) -> None:
        """``weight_scale`` from a state dict: its value cast to the module's dtype."""
        if given.is_meta or given.numel() != 1:
            return
        self.weight_scale.fill_(given.reshape(()).to(self.weight_scale.dtype))
        self._read_scale()

    @property
    def weight(self) -> torch.Tensor:
        """A meta tensor of the table's shape and ``dtype``: what code that
        reads ``embedding.weight.shape``, ``.dtype`` or ``.device`` needs to
        know, holding nothing.  Its device says the weight is in no device's
        memory: transformers' Qwen4Exp n-gram embedding, for one, moves its
        ids to ``weight.device`` unless that is "meta", so the ids reach the
        gather on their own device.  Not a parameter: it is not moved or
        cast by ``.to()``, and cannot be assigned (a tied weight cannot be
        served from disk); ``state_dict()`` holds the table itself."""
        weight = self._meta_weight
        if weight is None or weight.dtype != self.dtype:
            weight = self._meta_weight = torch.empty(
                (self.num_embeddings, self.embedding_dim), dtype=self.dtype, device="meta")
        return weight

    def __setattr__(self, name: str, value) -> None:
        if name == "weight":  # as tie_weights would
            raise AttributeError(f"DiskEmbedding.weight stands for the rows of table "
                                 f"{self.table.name!r}, which stay in its files: it cannot be "
                                 "assigned (a tied weight cannot be served from disk)")
        super().__setattr__(name, value)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ids = layer_ids(ids)
        dtype = self.dtype
        owner = self.prefetch_owner
        if dtype in OUTPUT_DTYPES:
            # The decoders' float32 product of the values and weight_scale,
            # rounded once to dtype, is torch's product in dtype
            # (ple.formats.applied_scale).
            return gather(self.table, ids, dtype, self.split, self.round_scale, self._scale_value,
                          owner)
        if dtype not in DTYPES:  # cast by .to() to a dtype no table's values widen to exactly
            raise TypeError(f"DiskEmbedding gives rows in {DTYPES}, not {dtype}")
        if self._holds_scale():
            # float64: the values (exact in float32) times weight_scale, in float64.
            values = gather(self.table, ids, torch.float32, self.split, scale=1.0, owner=owner)
            return values.to(dtype) * self.weight_scale
        return gather(self.table, ids, torch.float32, self.split, owner=owner).to(dtype)

    def row_ids(self, token_ids: torch.Tensor, seq_ids: torch.Tensor | None = None,
                context: torch.Tensor | None = None) -> torch.Tensor:
        """The table rows a forward of ``token_ids`` gathers: the ids
        themselves, as int64 of their shape and device.  A row is its id's
        alone: ``seq_ids`` and ``context`` (an n-gram layer's arguments,
        which :class:`NGramEmbedding` hashes) change nothing."""
        return layer_ids(token_ids).to(torch.int64)

    def close(self) -> None:
        """Closes the table (unmaps its files), and its checkpoint's; the
        module cannot run after."""
        self.table.close()
        if self.checkpoint is not self.table:
            self.checkpoint.close()

    def __enter__(self) -> "DiskEmbedding":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def extra_repr(self) -> str:
        padding = "" if self.padding_idx is None else f", padding_idx={self.padding_idx}"
        split = "" if self.split is None else f", {self.split}"
        rounding = ", round_scale=True" if self.round_scale else ""
        return (f"{self.num_embeddings}, {self.embedding_dim}, table={self.table.name!r} "
                f"({self.table.format}), dtype={self.dtype}{rounding}{padding}{split}")


# Rows compared at once when a state dict's table is checked against the files.
COMPARED_BYTES = 64 << 20


def _first_difference(given: torch.Tensor, ours: torch.Tensor) -> str | None:
    """Where ``given`` differs from ``ours`` (a tensor over the table's files)
    cast to ``given``'s dtype (a model loaded in another dtype holds the
    values cast), compared a slice of rows at a time; None where they are
    equal."""
    if given.shape != ours.shape:
        return f"shape {list(given.shape)} against {list(ours.shape)}"
    def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to("cpu", given.dtype).contiguous().reshape(tensor.shape[0], -1).view(
            torch.uint8)

    if ours.dim() == 0 or ours.numel() == 0:
        return None if torch.equal(as_bytes(given.reshape(1, -1)), as_bytes(ours.reshape(1, -1))) \
            else "its value"
    step = max(1, COMPARED_BYTES // max(1, ours[0].numel() * ours.element_size()))
    for start in range(0, ours.shape[0], step):
        a, b = as_bytes(given[start:start + step]), as_bytes(ours[start:start + step])
        if not torch.equal(a, b):
            row = start + int((a != b).reshape(a.shape[0], -1).any(1).nonzero()[0])
            return f"first at row {row}"
    return None

