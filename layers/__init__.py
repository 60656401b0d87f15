"""torch.nn modules over disk tables (the n-gram and packed GGUF embeddings
arrive with the layers issue)."""
