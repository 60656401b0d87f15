"""Qwen4Exp's n-gram tables in vLLM served by ple.

vLLM's Qwen4Exp (``vllm.models.qwen4_exp``, its CUDA classes) gives each PLE
decoder layer a ``Qwen4ExpPLELayer`` whose ``ple_embedding`` (a
``Qwen4ExpNGramEmbedding``) hashes each token's n-grams into row ids and
looks them up in ``ple_embedding.ngram_embedding``, a table of
``padded rows x head_dim`` that vLLM allocates whole on the GPU (or in pinned
host memory) and fills from the checkpoint's shards
``model.layers.{i}.ple.ple_embedding.ngram_embedding.shard_{j}.weight``;
an FP8 table's rows are dequantized by the PLE layer as
``rows.to(dtype) * weight_scale.to(dtype)``.

For the tables ``PLE_OFFLOAD`` asks for, :class:`NGramTables` has vLLM's PLE
layers build ple's :class:`Qwen4ExpNGramEmbedding` instead: the same
interface, its ``ngram_embedding`` a :class:`ple.layers.NGramEmbedding` over
the checkpoint's shard files.  It computes the ids as vLLM's module does
(``ple.layers.NGramHashing``, with the checkpoint's own constants) and
gathers the rows in the model's dtype, an FP8 table's scaled as vLLM scales
them (``round_scale=True``), so the PLE layer's dequantization has nothing
left to do.  The table's tensors are taken by its ``load_weights`` unread.

This module needs only vLLM's PLE layer, not its model classes (which
``ple.integrations.vllm.qwen4_exp_models`` builds), so it also imports where
the model's other parts do not (vLLM's CPU build without torchvision).
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn
from vllm.models.common.ops.sequence_parallel import sp_shard
from vllm.models.qwen4_exp.common.ngram_embedding import (Qwen4ExpPLEEmbeddingMethod,
                                                          Qwen4ExpPLEFp8EmbeddingMethod)

from ple.config import GatherConfig
from ple.layers.ngram_embedding import NGramEmbedding
from ple.safetensors_tables import SHARD_NAME

from .settings import settings
from .tables import (built_with, checkpoint_paths, keep_loading_lazy, key_compile_cache,
                     place_tiers, report)

# The end of vLLM's name of each n-gram table module (what PLE_OFFLOAD lists):
# model.layers.{i}.ple.ple_embedding.ngram_embedding, with language_model. in
# front in the multimodal class.
NGRAM_TABLE_MODULE = "ple.ple_embedding.ngram_embedding"
FP8_FORMAT = "fp8_e4m3fn"


class PreDequantizedNGramEmbedding(NGramEmbedding):
    """ple's n-gram embedding where vLLM's PLE layer expects its table
    module: the layer calls ``dequantize`` on the rows it was given, which
    the gather already made in the model's dtype (an FP8 table's as
    ``values.to(dtype) * scale.to(dtype)``, vLLM's own arithmetic)."""

    def dequantize(self, embeddings: torch.Tensor, output_dtype: torch.dtype) -> torch.Tensor:
        return embeddings


class Qwen4ExpNGramEmbedding(nn.Module):
    """vLLM's ``Qwen4ExpNGramEmbedding`` (``forward``, ``start_prefetch``,
    ``load_weights``) over ple's ``ngram_embedding``.  Each rank gathers full
    rows from the whole table, so with sequence parallelism it keeps its
    tokens' rows (vLLM's module reduce-scatters partial rows instead)."""

    def __init__(self, ngram_embedding: PreDequantizedNGramEmbedding,
                 use_sequence_parallel: bool = False):
        super().__init__()
        self.ngram_embedding = ngram_embedding
        self.use_sequence_parallel = use_sequence_parallel

    @classmethod
    def open(cls, files: list[Path], config, embedding_dim: int, ple_dense_layer_id: int, *,
             prefix: str, quant_config=None, params_dtype: torch.dtype | None = None,
             use_sequence_parallel: bool = False, gather: GatherConfig | None = None
             ) -> "Qwen4ExpNGramEmbedding":
        """The module over PLE layer ``ple_dense_layer_id``'s table in
        ``files`` (transformers' name for it, in the text or the published
        multimodal layout); the other arguments are vLLM's module's
        (``prefix``: its name).  A table that vLLM would not load (another
        shape, or FP8 where vLLM reads unscaled rows, or the other way round)
        is a ValueError."""
        dtype = params_dtype or torch.get_default_dtype()
        embedding = PreDequantizedNGramEmbedding.from_safetensors(
            files, model_config=config, ple_layer_index=ple_dense_layer_id, dtype=dtype,
            config=gather)
        try:
            _check_table(embedding, config, embedding_dim, f"{prefix}.ngram_embedding",
                         quant_config)
        except BaseException:
            embedding.table.close()
            raise
        return cls(embedding, use_sequence_parallel)

    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor,
                query_start_loc: torch.Tensor, ngram_context: torch.Tensor) -> torch.Tensor:
        """``[tokens, heads * head_dim]`` in the model's dtype."""
        token_ids = input_ids.reshape(-1)
        embeddings = self.ngram_embedding(token_ids, _request_ids(token_ids, query_start_loc),
                                          ngram_context)
        return sp_shard(embeddings) if self.use_sequence_parallel else embeddings

    def compute_ngram_ids(self, input_ids: torch.Tensor, query_start_loc: torch.Tensor,
                          ngram_context: torch.Tensor) -> torch.Tensor:
        """The table rows ``forward`` gathers, ``[tokens, heads]`` (vLLM's
        module's method of this name)."""
        token_ids = input_ids.reshape(-1)
        return self.ngram_embedding.row_ids(token_ids, _request_ids(token_ids, query_start_loc),
                                            ngram_context)

    def start_prefetch(self, input_ids: torch.Tensor, query_start_loc: torch.Tensor,
                       ngram_context: torch.Tensor) -> None:
        """Nothing: vLLM starts its pinned-host lookup a layer early; ple's
        gather reads its rows in ``forward``."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Takes the module's checkpoint tensors without reading them: the
        table is served from the files, and the hashing constants were read
        from the same files as the table opened.  The module has no
        parameters to report loaded."""
        for _ in weights:
            pass
        return set()


def _request_ids(token_ids: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
    """Each token's request, as vLLM's own ids take it: vLLM's
    ``query_start_loc`` has a zero-length request for each unused slot, and
    tokens after the last boundary (a CUDA graph's padding) belong to the
    last request."""
    boundaries = query_start_loc.long()
    positions = torch.arange(token_ids.shape[0], device=token_ids.device)
    return (torch.searchsorted(boundaries, positions, right=True) - 1).clamp(
        max=boundaries.numel() - 2)


def _check_table(embedding: NGramEmbedding, config, embedding_dim: int, name: str,
                 quant_config) -> None:
    """A ValueError unless vLLM's own module would load ``embedding``'s table
    as it is: ``padded rows x head_dim``, FP8 with its scale exactly where
    vLLM's quantization config reads FP8."""
    table = embedding.table
    heads = embedding.hashing.heads
    shape = (embedding.hashing.padded_rows(int(config.make_ngram_vocab_size_divisible_by)),
             embedding_dim // heads)
    if (table.num_rows, table.cols) != shape:
        raise ValueError(f"ple: {name} is a table of {shape[0]} x {shape[1]} ({heads} heads of "
                         f"ple_embed_dim {embedding_dim}), but {table.name!r} in "
                         f"{table.paths[0].parent} has {table.num_rows} rows of {table.cols}")
    method = Qwen4ExpPLEEmbeddingMethod.from_quant_config(
        quant_config, name, getattr(config, "ple_embedding_dtype", None))
    reads_fp8 = isinstance(method, Qwen4ExpPLEFp8EmbeddingMethod)
    if reads_fp8 != (table.format == FP8_FORMAT):
        raise ValueError(f"ple: vLLM reads {name} as {'FP8 rows and a scale' if reads_fp8 else 'unscaled rows'}"
                         f" ({type(method).__name__}), but its table {table.name!r} is "
                         f"{table.format}: ple serves the rows vLLM would compute, so it "
                         "serves only a table vLLM reads as stored")


class NGramTables:
    """The n-gram tables of one Qwen4Exp model that ple serves, as
    ``PLE_OFFLOAD`` asks: all with ``auto``, those named in a list, none with
    ``none``.  :meth:`building` wraps the building of vLLM's model;
    ``served``: ``{module name: ple's n-gram embedding}``."""

    def __init__(self, vllm_config):
        self.vllm_config = vllm_config
        self.asked = settings()
        self.served: dict[str, PreDequantizedNGramEmbedding] = {}
        self._in_memory_bytes: dict[str, int] = {}
        self._built: list[str] = []
        self._files: list[Path] | None = None
        # The checkpoint's names of the served tables' tensors (shard
        # families by their prefix) and of their scales.
        self._tensors: set[str] = set()

    @property
    def asked_for(self) -> bool:
        return self.asked.offload == "auto" or bool(self.asked.offload)

    @contextmanager
    def building(self, ple_layer_module):
        """While vLLM builds the model, the PLE layers of ``ple_layer_module``
        (vLLM's module that defines ``Qwen4ExpPLELayer``) build ple's n-gram
        module for each table asked for, vLLM's for the others: vLLM's would
        allocate its table whole first.  Then checks that every name asked
        for was built, keeps vLLM's loader lazy, keys its compile cache on
        the tables and logs them."""
        def build(config, embedding_dim, ple_dense_layer_id, max_total_tokens, *, original,
                  prefix, **options):
            name = f"{prefix}.ngram_embedding"
            self._built.append(name)
            if not self._serves(name):
                return original(config, embedding_dim, ple_dense_layer_id, max_total_tokens,
                                prefix=prefix, **options)
            return self._open(name, config, embedding_dim, ple_dense_layer_id, prefix, options)

        with built_with(ple_layer_module, "Qwen4ExpNGramEmbedding", build):
            yield self
        self._refuse_unknown()
        if self.served:
            keep_loading_lazy(self.vllm_config.load_config)
            key_compile_cache(self.vllm_config, {name: m.table for name, m in self.served.items()})
            report({name: (m, m.table.tensor_names) for name, m in self.served.items()},
                   self._in_memory_bytes)

    def holds(self, tensor: str) -> bool:
        """Whether checkpoint tensor ``tensor`` belongs to a served table
        (vLLM's ``is_unused_checkpoint_weight``: its loaders skip the files
        that hold only such tensors)."""
        shard = SHARD_NAME.match(tensor)
        return (shard["prefix"] if shard else tensor) in self._tensors

    def _serves(self, name: str) -> bool:
        return self.asked.offload == "auto" or name in (self.asked.offload or ())

    def _open(self, name: str, config, embedding_dim: int, ple_dense_layer_id: int, prefix: str,
              options: dict) -> Qwen4ExpNGramEmbedding:
        if self._files is None:
            self._files = checkpoint_paths(self.vllm_config)
        module = Qwen4ExpNGramEmbedding.open(
            self._files, config, embedding_dim, ple_dense_layer_id, prefix=prefix,
            quant_config=options.get("quant_config"), params_dtype=options.get("params_dtype"),
            use_sequence_parallel=options.get("use_sequence_parallel", False),
            gather=self.asked.gather)
        embedding = module.ngram_embedding
        place_tiers(embedding, self.vllm_config, self.asked)
        table = embedding.table
        # vLLM holds an FP8 table as stored, any other in the model's dtype.
        value_bytes = 1 if table.format == FP8_FORMAT else embedding.dtype.itemsize
        self._in_memory_bytes[name] = table.num_rows * table.cols * value_bytes
        self._tensors |= {table.name, f"{table.name}.weight_scale", f"{table.name}_scale"}
        self.served[name] = embedding
        return module

    def _refuse_unknown(self) -> None:
        if not isinstance(self.asked.offload, tuple):
            return
        unknown = [name for name in self.asked.offload if name not in self._built]
        if unknown:
            raise ValueError(f"ple: PLE_OFFLOAD names {unknown}, which this Qwen4Exp model has "
                             f"not as an n-gram table ple can serve: its tables are "
                             f"{self._built or 'none'}")

