"""Gemma 3n in vLLM with ``embed_tokens_per_layer`` served by ple.

``Gemma3nForCausalLM`` replaces vLLM's class of that name (the plugin
registers it); vLLM's multimodal ``Gemma3nForConditionalGeneration`` builds
its text model through the same registry entry, so both classes get it.  It
is vLLM's model but for two things:

- the offloaded tables (``PLE_OFFLOAD``): the module
  ``model.self_decoder.embed_tokens_per_layer`` (a ``VocabParallelEmbedding``
  in vLLM, which vLLM's text model builds on the meta device here: its
  parameter holds no memory) is a :class:`ple.layers.DiskEmbedding` over the checkpoint's
  tensor ``model.embed_tokens_per_layer.weight`` (published multimodal
  checkpoints: ``model.language_model.embed_tokens_per_layer.weight``), in
  the model's dtype: the rows are torch's cast of the stored values, as the
  copy into vLLM's parameter makes them, so the model computes the same bits.
  ``load_weights`` leaves the tensor out, and the loader hands tensors over
  memory-mapped, so its bytes are never read at load.
- the per-layer inputs: vLLM 0.32's text-only class never computes them (its
  forward passes ``per_layer_inputs=None`` on, so the table changes
  nothing; only the multimodal class computes them, in ``embed_input_ids``).
  ple's text model computes them from the token ids as transformers does,
  inside the compiled forward: ``embed_tokens_per_layer(ids masked to the
  per-layer vocabulary) * sqrt(hidden_size_per_layer_input)``, reshaped to
  ``[tokens, layers, hidden_size_per_layer_input]`` (vLLM's own
  ``get_per_layer_input_embeddings``), then mixed with the projection of the
  token embeddings by vLLM's ``get_per_layer_inputs``.  A log line says so.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import nullcontext

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.models import gemma3n
from vllm.model_executor.models.utils import maybe_prefix

from ple.layers.disk_embedding import DiskEmbedding

from .settings import Settings, settings
from .tables import (checkpoint_paths, keep_loading_lazy, key_compile_cache, logger,
                     open_embedding, report, table_on_meta)

# The module "auto" serves, under the text model, and its checkpoint tensor.
PER_LAYER_MODULE = "self_decoder.embed_tokens_per_layer"
PER_LAYER_TENSOR = "model.embed_tokens_per_layer.weight"
# The end of the prefix vLLM's self-decoder builds that module with.
PER_LAYER_PREFIX = ".per_layer_embed_tokens"


class Gemma3nTextModel(gemma3n.Gemma3nTextModel):
    """vLLM's text model (compiled by vLLM as its own: the class inherits
    its ``support_torch_compile``), whose forward computes the per-layer
    inputs from the token ids when it is not given them."""

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                per_layer_inputs: torch.Tensor | None = None, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs):
        if per_layer_inputs is None and input_ids is not None:
            per_layer_inputs = self.get_per_layer_input_embeddings(input_ids).reshape(
                -1, self.config.num_hidden_layers, self.config.hidden_size_per_layer_input)
        return super().forward(input_ids, positions, per_layer_inputs, intermediate_tensors,
                               inputs_embeds, **kwargs)


class Gemma3nForCausalLM(gemma3n.Gemma3nForCausalLM):
    """vLLM's ``Gemma3nForCausalLM`` over :class:`Gemma3nTextModel`, its
    ``embed_tokens_per_layer`` served by ple as ``PLE_OFFLOAD`` asks.
    ``ple_tables``: ``{module name: table}``."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        # vLLM's __init__, but for the text model's class (building vLLM's
        # first would build another table), whose table is built on the meta
        # device when ple serves it.
        nn.Module.__init__(self)
        config = vllm_config.model_config.hf_config
        self.config = config
        self.cache_config = vllm_config.cache_config
        asked = settings()
        if isinstance(asked.offload, tuple):
            _refuse_unknown(asked.offload)
        offloaded = asked.offload == "auto" or bool(_text_model_names(asked.offload))
        with table_on_meta(gemma3n, PER_LAYER_PREFIX) if offloaded else nullcontext():
            self.model = Gemma3nTextModel(vllm_config=vllm_config,
                                          prefix=maybe_prefix(prefix, "model"))
        self.logits_processor = LogitsProcessor(config.vocab_size,
                                                soft_cap=config.final_logit_softcapping)
        self._served = self._offload(vllm_config, prefix, asked) if offloaded else {}
        if vllm_config.model_config.architecture == "Gemma3nForCausalLM":
            logger.info("ple: vLLM's text-only Gemma3nForCausalLM computes no per-layer inputs "
                        "(its table changes nothing); ple's computes them from "
                        "embed_tokens_per_layer as transformers does")

    @property
    def ple_tables(self):
        return {name: module.table for name, (module, _) in self._served.items()}

    def _offload(self, vllm_config: VllmConfig, prefix: str, asked: Settings
                 ) -> dict[str, tuple[DiskEmbedding, str]]:
        """Puts ple's module in place of vLLM's table, built on the meta
        device."""
        full_name = maybe_prefix(prefix, f"model.{PER_LAYER_MODULE}")
        keep_loading_lazy(vllm_config.load_config)
        original = self.model.self_decoder.embed_tokens_per_layer
        if not original.weight.is_meta:
            raise RuntimeError(f"ple: this vLLM builds Gemma 3n's {PER_LAYER_MODULE} otherwise "
                               f"than vLLM 0.32 (with a prefix ending {PER_LAYER_PREFIX!r}), and "
                               "allocated the table ple serves: ple's Gemma 3n needs revising "
                               "for it")
        shape = (self.config.vocab_size_per_layer_input,
                 self.config.num_hidden_layers * self.config.hidden_size_per_layer_input)
        module = open_embedding(full_name, checkpoint_paths(vllm_config), PER_LAYER_TENSOR, shape,
                                vllm_config, asked)
        in_memory = original.weight.numel() * original.weight.element_size()
        self.model.self_decoder.embed_tokens_per_layer = module
        served = {full_name: (module, module.table.name)}
        key_compile_cache(vllm_config, {name: m.table for name, (m, _) in served.items()})
        report(served, {full_name: in_memory})
        return served

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
    """Whether checkpoint tensor ``name`` (as vLLM's loader hands it to the
    text model: ``model.embed_tokens_per_layer.weight``) is the table."""
    return name.endswith("embed_tokens_per_layer.weight")


def _text_model_names(names) -> list[str]:
    """The names of PLE_OFFLOAD as the text-only class names its modules (the
    multimodal class's ``language_model.`` taken off)."""
    return [name.removeprefix("language_model.") for name in names or ()]


def _refuse_unknown(names: tuple[str, ...]) -> None:
    """A ValueError for names of PLE_OFFLOAD that are no module ple serves."""
    unknown = [n for n, relative in zip(names, _text_model_names(names))
               if relative != f"model.{PER_LAYER_MODULE}"]
    if unknown:
        raise ValueError(f"ple: PLE_OFFLOAD names {unknown}, which Gemma 3n has not as an "
                         f"embedding ple can serve: it serves 'model.{PER_LAYER_MODULE}' "
                         f"('language_model.model.{PER_LAYER_MODULE}' in the multimodal class; "
                         "its other embedding, embed_tokens, is tied to the logits)")
