"""``ple.kernels``, ``ple.ops`` and ``ple.layers``: the folders kernels/,
ops/ and layers/, which have no ``__init__.py``.

With one, a folder is a regular package, and Python started in a checkout's
root (where ``make demo`` leaves a user and ``python -m pytest`` runs) takes
it for every package of its name: the checkout's kernels/ hid Hugging Face's
``kernels``, which transformers imports.  Without one, it is a namespace
portion, which Python passes over for a regular package of that name
anywhere on ``sys.path``.

A wheel holds the folders in ple/, where Python finds them.  A checkout holds
them beside ple/ (setup.py maps them into ple), where setuptools' editable
install finds no sub-package that lacks an ``__init__.py``:
:func:`subpackage` then names the folder itself.

What their ``__init__.py`` did is done by ple's: ``import ple`` registers the
operators (it imports ``ple.ops.disk_gather``) and gives ``ple.layers`` its
layers by name (:func:`export_lazily`).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def subpackage(name: str) -> ModuleType:
    """``ple.<name>``, where Python finds it, else the checkout's folder
    ``name`` beside ple/."""
    full_name = f"{__package__}.{name}"
    if importlib.util.find_spec(full_name) is None:
        spec = importlib.machinery.ModuleSpec(full_name, None, is_package=True)
        spec.submodule_search_locations = [str(Path(__file__).resolve().parents[1] / name)]
        sys.modules[full_name] = importlib.util.module_from_spec(spec)
    return importlib.import_module(full_name)


def export_lazily(package: ModuleType, names: dict[str, str]) -> None:
    """Gives ``package`` the attributes ``names``, each imported on first use
    from the module ``names[name]`` in it (``from ple.layers import
    DiskEmbedding``), so that importing ple imports none of them."""

    def __getattr__(name: str):
        if name not in names:
            raise AttributeError(f"module {package.__name__!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package.__name__}.{names[name]}"), name)

    package.__getattr__ = __getattr__
    package.__all__ = sorted(names)
