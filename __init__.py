"""The top folder of a checkout of ple.  Python imports it as ``ple`` only
when it runs in the folder that holds a checkout named ``ple``; the package
is the checkout's ple/ folder, installed with pip (README.md, Install)."""

import os

raise ImportError(
    f"'ple' was imported from {os.path.dirname(__file__)}, the top folder of a checkout of the ple "
    "repository, because Python runs in the folder that holds it; the package is the checkout's ple "
    "folder, installed with pip: run Python from another folder")
