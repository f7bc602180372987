"""The fake SGLang (tests/fake_sglang/__init__.py)."""
