"""meshnet: distributed LLM inference over layer shards served by many nodes."""

__version__ = "0.1.0"
