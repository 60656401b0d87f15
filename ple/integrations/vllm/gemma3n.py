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

from contextlib import nullcontext

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.models import gemma3n
from vllm.model_executor.models.utils import maybe_prefix

from .per_layer import ServesPerLayerTable
from .settings import Settings, settings
from .tables import logger, table_on_meta

# The module "auto" serves, under the text model.
PER_LAYER_MODULE = "self_decoder.embed_tokens_per_layer"
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


class Gemma3nForCausalLM(ServesPerLayerTable, gemma3n.Gemma3nForCausalLM):
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
        if offloaded:
            self._offload(vllm_config, prefix, asked)
        if vllm_config.model_config.architecture == "Gemma3nForCausalLM":
            logger.info("ple: vLLM's text-only Gemma3nForCausalLM computes no per-layer inputs "
                        "(its table changes nothing); ple's computes them from "
                        "embed_tokens_per_layer as transformers does")

    def _offload(self, vllm_config: VllmConfig, prefix: str, asked: Settings) -> None:
        """Puts ple's module in place of vLLM's table, built on the meta device."""
        original = self.model.self_decoder.embed_tokens_per_layer
        self.model.self_decoder.embed_tokens_per_layer = self.serve_per_layer_table(
            original, maybe_prefix(prefix, f"model.{PER_LAYER_MODULE}"), vllm_config, asked,
            "Gemma 3n")


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
