"""ple: gathers rows of embedding tables far larger than RAM straight from
their checkpoint files, as ``torch.ops.ple`` operators.

    import ple, torch
    with ple.Table.from_safetensors("ckpt/") as table:
        rows = torch.ops.ple.disk_gather(ids, table.handle, torch.bfloat16)
"""

from . import ops  # noqa: F401  (registers torch.ops.ple)
from .config import POLICIES, GatherConfig
from .formats import FORMATS
from .table import Table

__all__ = ["FORMATS", "POLICIES", "GatherConfig", "Table"]
