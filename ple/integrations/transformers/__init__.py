"""transformers models whose embedding tables stay in the checkpoint's
files (docs/transformers.md).

    from ple.integrations.transformers import from_pretrained, tables
    model = from_pretrained(AutoModelForCausalLM, "checkpoint/", dtype=torch.bfloat16)

- ``loading``: :func:`from_pretrained`, :func:`offload`;
- ``keys``: which checkpoint tensors hold a module's weight;
- ``modules``: the modules put in place of the embeddings, and the swap;
- ``generate``: ``generate`` with lookahead for the models ple serves.
"""

from .loading import from_pretrained, offload
from .modules import ScaledDiskEmbedding, close_tables, tables

__all__ = ["ScaledDiskEmbedding", "close_tables", "from_pretrained", "offload", "tables"]
