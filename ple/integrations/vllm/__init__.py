"""ple inside vLLM: a general plugin that serves a model's large embedding
tables from the checkpoint's files (docs/vllm.md).

vLLM loads the plugin in each of its processes (the entry point ``ple`` of
the group ``vllm.general_plugins``); it changes nothing until a ``PLE_*``
variable asks:

    PLE_OFFLOAD=auto vllm serve google/gemma-3n-E4B-it

- ``settings``: the ``PLE_*`` variables and the ``PLE_CONFIG`` file;
- ``tables``: what every model class does around its tables (files, tables,
  the lazy loader, the compile cache key, the log lines, the build-time swap);
- ``per_layer``: what ple's Gemma 3n and Gemma 4 classes share (the
  per-layer table);
- ``gemma3n``, ``gemma4``, ``qwen4_exp``, ``qwen4_exp_models``: ple's model
  classes;
- ``lookahead``: the rows of a prefill's coming chunks, read ahead.
"""

from __future__ import annotations

import os

__all__ = ["ARCHITECTURES", "register"]

PREFIX = "PLE_"
# The architectures whose vLLM classes ple's replace, and where ple's live.
ARCHITECTURES = {
    "Gemma3nForCausalLM": "ple.integrations.vllm.gemma3n:Gemma3nForCausalLM",
    "Gemma4ForCausalLM": "ple.integrations.vllm.gemma4:Gemma4ForCausalLM",
    "Qwen4ExpForCausalLM": "ple.integrations.vllm.qwen4_exp_models:Qwen4ExpForCausalLM",
    "Qwen4ExpForConditionalGeneration":
        "ple.integrations.vllm.qwen4_exp_models:Qwen4ExpForConditionalGeneration",
}


def register() -> None:
    """The plugin's entry point (``vllm.general_plugins``): vLLM calls it in
    each of its processes.  Returns at once when no ``PLE_*`` variable is
    set.  Otherwise reads the settings (a bad one raises, and vLLM does not
    start), and when they ask for ple, replaces vLLM's classes of the
    architectures ple serves with ple's and wraps the workers'
    ``execute_model`` for lookahead."""
    if not any(name.upper().startswith(PREFIX) for name in os.environ):
        return
    import logging

    from .settings import OFFLOAD_ENV, settings

    asked = settings()
    if not asked.active:
        return
    from vllm import ModelRegistry

    from .lookahead import install

    for architecture, target in ARCHITECTURES.items():
        ModelRegistry.register_model(architecture, target)
    # Each engine's workers read PLE_LOOKAHEAD_MIB at their first step: the
    # hook is in place whatever this first reading says.
    install()
    logging.getLogger(__name__).debug("ple: serving %s through ple (%s=%s)",
                                      ", ".join(ARCHITECTURES), OFFLOAD_ENV, asked.offload)
