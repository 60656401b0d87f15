"""The top folder of a checkout of ple, which gives way to the ple installed.

Python imports this folder as ``ple`` when it runs in the folder that holds
a checkout named ``ple`` (pytest too, which imports the ``__init__.py`` of
the folders above a test).  Without this file the folder would be a
namespace package there, which hides a ple installed in editable mode
(setuptools' finder comes after the folders on ``sys.path``) and has none of
ple's names.  With it, ``import ple`` imports the ple that Python finds
without this folder, or says that there is none.
"""

if __name__ == "ple":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    def _installed_spec():
        """The spec of the ple that every finder finds on ``sys.path`` less
        the folder holding this checkout; None if none is installed."""
        here = os.path.realpath(__file__)
        holder = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        entries = [e for e in sys.path if os.path.realpath(e or os.curdir) != holder]
        for finder in sys.meta_path:
            if finder is importlib.machinery.PathFinder:
                spec = finder.find_spec(__name__, entries)
            else:
                spec = getattr(finder, "find_spec", lambda name, path: None)(__name__, None)
            if spec is not None and spec.loader is not None and (
                    spec.origin is None or os.path.realpath(spec.origin) != here):
                return spec
        return None

    _spec = _installed_spec()
    if _spec is None:
        raise ImportError(
            f"'ple' was imported from {os.path.dirname(os.path.abspath(__file__))}, a checkout of "
            "the ple repository, because Python runs in the folder that holds it; no ple is "
            "installed: install it (README.md, Install)")
    # Python takes the module this one leaves in sys.modules as the import's result.
    sys.modules[__name__] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules[__name__])
