"""Operators registered in the ``torch.ops.ple`` namespace."""

from . import disk_gather  # noqa: F401  (registers the operators)
