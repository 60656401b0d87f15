"""Kernels: the native memory-mapped row gather (C++) and the row decoders."""
