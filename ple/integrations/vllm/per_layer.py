"""What ple's Gemma 3n and Gemma 4 classes share: the per-layer table
(``model.embed_tokens_per_layer.weight`` in a text checkpoint,
``model.language_model.embed_tokens_per_layer.weight`` in a published
multimodal one), served by a :class:`ple.layers.DiskEmbedding` in place of
vLLM's, which vLLM builds on the meta device (``tables.table_on_meta``),
and left out of what vLLM's loaders read."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType

import torch
from torch import nn

from ple.layers.disk_embedding import DiskEmbedding

from .settings import Settings
from .tables import checkpoint_paths, keep_loading_lazy, key_compile_cache, open_embedding, report

PER_LAYER_TENSOR = "model.embed_tokens_per_layer.weight"


class ServesPerLayerTable:
    """A vLLM model class mixin: ``ple_tables`` (``{module name: table}``),
    the table opened in place of vLLM's, and the checkpoint tensor skipped."""

    # Until serve_per_layer_table sets the instance's own: nothing served.
    _served: Mapping[str, tuple[DiskEmbedding, str]] = MappingProxyType({})

    @property
    def ple_tables(self):
        return {name: module.table for name, (module, _) in self._served.items()}

    def serve_per_layer_table(self, original: nn.Module, name: str, vllm_config,
                              asked: Settings, family: str) -> DiskEmbedding:
        """ple's module over the checkpoint's per-layer table, for the class to
        put where vLLM's model holds ``original`` (vLLM's, named ``name``,
        which must have been built on the meta device: ``family`` names the
        model in the error where it was not)."""
        keep_loading_lazy(vllm_config.load_config)
        if not original.weight.is_meta:
            raise RuntimeError(f"ple: this vLLM builds {family}'s per-layer table otherwise than "
                               "vLLM 0.32, and allocated the table ple serves: ple's "
                               f"{family} needs revising for it")
        config = self.config
        shape = (config.vocab_size_per_layer_input,
                 config.num_hidden_layers * config.hidden_size_per_layer_input)
        module = open_embedding(name, checkpoint_paths(vllm_config), PER_LAYER_TENSOR, shape,
                                vllm_config, asked)
        self._served = {name: (module, module.table.name)}
        key_compile_cache(vllm_config, {name: module.table})
        report(self._served, {name: original.weight.numel() * original.weight.element_size()})
        return module

    def is_unused_checkpoint_weight(self, name: str) -> bool:
        """vLLM's loaders skip the files that hold only such tensors (the
        whole-file loaders too)."""
        return bool(self._served) and _is_per_layer_table(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        if self._served:
            weights = ((name, tensor) for name, tensor in weights
                       if not _is_per_layer_table(name))
        return super().load_weights(weights)


def _is_per_layer_table(name: str) -> bool:
    """Whether checkpoint tensor ``name`` (in either layout) is the table."""
    return name.endswith("embed_tokens_per_layer.weight")
