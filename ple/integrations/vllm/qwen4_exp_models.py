"""vLLM's Qwen4Exp classes with their n-gram tables served by ple
(``ple.integrations.vllm.qwen4_exp``).

The plugin registers both in place of vLLM's: ``Qwen4ExpForCausalLM`` and the
multimodal ``Qwen4ExpForConditionalGeneration`` (the published checkpoints'
class), which builds vLLM's text model itself rather than through the
registry.  Each is vLLM's class built inside :meth:`NGramTables.building`, so
that the PLE layers asked for get ple's n-gram module, and tells vLLM's
loaders which checkpoint tensors it leaves unread.

ple serves the tables of vLLM's CUDA classes (``vllm.models.qwen4_exp.nvidia``);
on ROCm vLLM builds other classes with their own n-gram module, and asking
for a table there is a ValueError.
"""

from __future__ import annotations

from vllm.config import VllmConfig
from vllm.models import qwen4_exp
from vllm.models.qwen4_exp.nvidia import ple_layer as cuda_ple_layer
from vllm.platforms import current_platform

from .qwen4_exp import NGramTables


def _tables(vllm_config: VllmConfig) -> NGramTables:
    tables = NGramTables(vllm_config)
    if tables.asked_for and current_platform.is_rocm():
        raise ValueError("ple: vLLM's Qwen4Exp on ROCm builds its own n-gram module "
                         "(vllm.models.qwen4_exp.amd), which ple does not serve; its tables stay "
                         "vLLM's with PLE_OFFLOAD unset or 'none'")
    return tables


class ServesNGramTables:
    """What both classes add to vLLM's: ``ple_tables`` (``{module name:
    table}``) and the checkpoint tensors vLLM's loaders may skip."""

    ngram_tables: NGramTables

    @property
    def ple_tables(self):
        return {name: module.table for name, module in self.ngram_tables.served.items()}

    def is_unused_checkpoint_weight(self, name: str) -> bool:
        return self.ngram_tables.holds(name)


class Qwen4ExpForCausalLM(ServesNGramTables, qwen4_exp.Qwen4ExpForCausalLM):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        tables = _tables(vllm_config)
        with tables.building(cuda_ple_layer):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.ngram_tables = tables


class Qwen4ExpForConditionalGeneration(ServesNGramTables,
                                       qwen4_exp.Qwen4ExpForConditionalGeneration):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "model"):
        tables = _tables(vllm_config)
        with tables.building(cuda_ple_layer):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.ngram_tables = tables
