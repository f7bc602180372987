"""The process itself: how signals reach the daemon (signals.py)."""
