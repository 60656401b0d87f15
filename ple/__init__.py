"""ple: gathers rows of embedding tables far larger than RAM straight from
their checkpoint files, as ``torch.ops.ple`` operators.

    import ple, torch
    with ple.Table.from_safetensors("ckpt/") as table:
        rows = ple.gather(table, ids, torch.bfloat16)   # torch.ops.ple.disk_gather(ids, table.handle, ...)
"""

__version__ = "0.2.0"

from .subpackages import export_lazily, subpackage  # noqa: E402

# The folders kernels/, ops/ and layers/ (ple/subpackages.py says why they have
# no __init__.py).
kernels = subpackage("kernels")
ops = subpackage("ops")
layers = subpackage("layers")
export_lazily(layers, {"DiskEmbedding": "disk_embedding", "NGramEmbedding": "ngram_embedding",
                       "NGramHashing": "ngram_ids", "PackedGGUFEmbedding": "packed_gguf_embedding"})

from .config import POLICIES, GatherConfig  # noqa: E402
from .counters import COUNTERS  # noqa: E402
from .formats import FORMATS  # noqa: E402
from .ops.disk_gather import gather  # noqa: E402  (registers torch.ops.ple)
from .table import Table  # noqa: E402

__all__ = ["COUNTERS", "FORMATS", "POLICIES", "GatherConfig", "Table", "__version__", "gather"]
