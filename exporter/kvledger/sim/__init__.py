"""Simulated engines and GPUs for the demo and the tests (no GPU or engine needed)."""
