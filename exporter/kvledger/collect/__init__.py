"""Collecting facts: one source per engine kind (and NVML, /proc), polling, the merge of configured and reported facts."""
