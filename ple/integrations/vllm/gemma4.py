"""Gemma 4 in vLLM with ``embed_tokens_per_layer`` served by ple.

``Gemma4ForCausalLM`` replaces vLLM's class of that name (the plugin
registers it); vLLM's multimodal ``Gemma4ForConditionalGeneration`` builds
its language model through the same registry entry, so both classes get it.
It is vLLM's model but for the per-layer table ``PLE_OFFLOAD`` asks for:
``model.embed_tokens_per_layer`` (which the text model's self-decoder holds
too; vLLM builds it on the meta device here, so its parameter holds no
memory) is a :class:`ple.layers.DiskEmbedding` over the checkpoint's tensor
``model.language_model.embed_tokens_per_layer.weight`` (the published
layout; ``model.embed_tokens_per_layer.weight`` in a text checkpoint), in
the model's dtype: the rows are torch's cast of the stored values, as the
copy into vLLM's parameter makes them, and vLLM's model multiplies them by
its ``embed_scale_per_layer`` as before, so the model computes the same
bits.  ``load_weights`` leaves the tensor out, and the loader hands tensors
over memory-mapped, so its bytes are never read at load.  A Gemma 4 without
per-layer inputs (``hidden_size_per_layer_input`` 0) has no table to serve,
and a log line says so.
"""

from __future__ import annotations

from contextlib import nullcontext

from vllm.config import VllmConfig
from vllm.model_executor.models import gemma4
from vllm.model_executor.models.utils import maybe_prefix

from .per_layer import ServesPerLayerTable
from .settings import Settings, settings
from .tables import logger, table_on_meta

# The module "auto" serves, under the text model.
PER_LAYER_MODULE = "embed_tokens_per_layer"


class Gemma4ForCausalLM(ServesPerLayerTable, gemma4.Gemma4ForCausalLM):
    """vLLM's ``Gemma4ForCausalLM``, its ``embed_tokens_per_layer`` served by
    ple as ``PLE_OFFLOAD`` asks.  ``ple_tables``: ``{module name: table}``."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        asked = settings()
        full_name = maybe_prefix(prefix, f"model.{PER_LAYER_MODULE}")
        if isinstance(asked.offload, tuple):
            _refuse_unknown(asked.offload, full_name)
        # "auto", or names that (past the refusal) are all this table's, with
        # or without the multimodal class's "language_model." ("none": ()).
        offloaded = bool(asked.offload)
        with table_on_meta(gemma4, f".{PER_LAYER_MODULE}") if offloaded else nullcontext():
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        if offloaded and self.model.embed_tokens_per_layer is None:
            logger.info("ple: this Gemma 4 has no per-layer inputs (hidden_size_per_layer_input "
                        "is 0): no table to serve")
        elif offloaded:
            self._offload(vllm_config, full_name, asked)

    def _offload(self, vllm_config: VllmConfig, full_name: str, asked: Settings) -> None:
        """Puts ple's module in place of vLLM's table (built on the meta device),
        in the text model and in its self-decoder."""
        module = self.serve_per_layer_table(self.model.embed_tokens_per_layer, full_name,
                                            vllm_config, asked, "Gemma 4")
        self.model.embed_tokens_per_layer = module
        self.model.self_decoder.embed_tokens_per_layer = module


def _refuse_unknown(names: tuple[str, ...], full_name: str) -> None:
    """A ValueError for names of PLE_OFFLOAD that are no module ple serves
    (the multimodal class names its text model's modules with
    ``language_model.`` in front, which ``full_name`` has there)."""
    unknown = [name for name in names if name.removeprefix("language_model.")
               != full_name.removeprefix("language_model.")]
    if unknown:
        raise ValueError(f"ple: PLE_OFFLOAD names {unknown}, which Gemma 4 has not as an "
                         f"embedding ple can serve: it serves 'model.{PER_LAYER_MODULE}' "
                         f"('language_model.model.{PER_LAYER_MODULE}' in the multimodal class; "
                         "its other embedding, embed_tokens, is tied to the logits)")
