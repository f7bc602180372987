"""Every engine kind kvledger reads: one line each, importing the kind's registration
(``<kind>/kind.py``: its source class, its own keys, its rules and its page), which fills
``kvledger.config.engine_kinds.KINDS``. The order of the lines is the kinds' order (the
error for an unknown kind, the generated table of kinds).

The entry points import this module before they read a configuration: the CLI, the
registry that builds sources, the merge of configured facts, the simulator, the docs
generator and the tests' conftest; the configuration reads the table it fills without
importing ``collect/`` (docs/adding-an-engine.md).
"""

# ruff: noqa: F401, I001  (each import is a registration; their order is the kinds' order)

from __future__ import annotations

import kvledger.collect.sources.ledger.kind
import kvledger.collect.sources.vllm.kind
import kvledger.collect.sources.sglang.kind
import kvledger.collect.sources.trtllm.kind
import kvledger.collect.sources.triton_trtllm.kind
import kvledger.collect.sources.tgi.kind
import kvledger.collect.sources.llamacpp.kind
