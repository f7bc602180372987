"""The in-engine kvledger/v1 ledger for SGLang (docs/engines/sglang.md, "With the plugin").

An SGLang general plugin (entry point ``sglang.srt.plugins``: ``kvledger``, ``plugin.register``)
loaded in the scheduler process; inert unless ``KVLEDGER_SGLANG_LEDGER`` is set. Standard
library only: it installs into SGLang's environment and adds nothing else there.
"""
