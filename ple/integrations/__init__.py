"""ple under other libraries' models: ``ple.integrations.transformers`` loads
Hugging Face transformers models with their largest embedding tables left in
the checkpoint's files.  Each integration imports its library only when it is
imported itself."""
