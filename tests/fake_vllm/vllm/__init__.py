"""Fake vLLM 0.32 for kvledger's unit tests (see tests/fake_vllm/__init__.py)."""
