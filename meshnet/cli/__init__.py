"""Typer command-line interface: ``meshnet serve | node | tracker | tui | chat | models | ...``."""
