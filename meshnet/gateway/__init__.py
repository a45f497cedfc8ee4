"""OpenAI-compatible API and the pipeline orchestrator that drives a generation across hops."""
