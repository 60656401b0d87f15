"""ple: gathers rows of embedding tables far larger than RAM straight from
their checkpoint files, as ``torch.ops.ple`` operators.

    import ple, torch
    with ple.Table.from_safetensors("ckpt/") as table:
        rows = ple.gather(table, ids, torch.bfloat16)   # torch.ops.ple.disk_gather(ids, table.handle, ...)
"""

__version__ = "0.2.0"

from . import ops  # noqa: E402  (registers torch.ops.ple)
from .config import POLICIES, GatherConfig  # noqa: E402
from .counters import COUNTERS  # noqa: E402
from .formats import FORMATS  # noqa: E402
from .ops.disk_gather import gather  # noqa: E402
from .table import Table  # noqa: E402

__all__ = ["COUNTERS", "FORMATS", "POLICIES", "GatherConfig", "Table", "__version__", "gather"]
