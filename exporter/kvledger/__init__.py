"""kvledger: one declared KV-cache accounting policy for LLM inference servers."""

__version__ = "0.1.0"
