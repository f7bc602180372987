"""Commands beside the daemon: the planner (kvledger plan), the cache lab and the docs generator."""
