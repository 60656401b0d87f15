"""Test only: lets vLLM's multimodal Gemma 4 import without torchvision, in
every process of a vLLM session whose PYTHONPATH names this directory
(tests/test_vllm_gemma4.py, tests/test_vllm_load_allocations.py; Python
imports ``sitecustomize`` at start-up, vLLM's registry inspects the model in
a process of its own).

vLLM's ``gemma4_mm`` imports transformers' ``Gemma4Processor``, whose module
imports ``Gemma4ImageProcessorKwargs`` and
``get_aspect_ratio_preserving_size`` from the torchvision image processor's
module, which imports torchvision; no torchvision loads beside torch 2.13's
CPU build (docs/vllm.md).  The PIL image processor's module defines the same
two names: where torchvision is not installed, that module is imported
under the torchvision one's name."""

import importlib
import importlib.abc
import importlib.util
import sys

TORCHVISION_MODULE = "transformers.models.gemma4.image_processing_gemma4"
PIL_MODULE = "transformers.models.gemma4.image_processing_pil_gemma4"


class PilImageProcessing(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports TORCHVISION_MODULE as a module holding PIL_MODULE's names."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name == TORCHVISION_MODULE else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        pil = importlib.import_module(PIL_MODULE)
        module.__dict__.update({key: value for key, value in vars(pil).items()
                                if not key.startswith("__")})


if importlib.util.find_spec("torchvision") is None:
    sys.meta_path.insert(0, PilImageProcessing())
