"""Data layers, the DataTransformer, dataset sources and tools (being written)."""
