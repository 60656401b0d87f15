"""torch.nn modules over disk tables: an nn.Embedding lookup, the hashed
n-gram embedding of a PLE model, a packed GGUF token embedding, and their row
split across ranks."""

from .disk_embedding import DiskEmbedding
from .ngram_embedding import NGramEmbedding
from .ngram_ids import NGramHashing
from .packed_gguf_embedding import PackedGGUFEmbedding

__all__ = ["DiskEmbedding", "NGramEmbedding", "NGramHashing", "PackedGGUFEmbedding"]
