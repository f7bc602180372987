"""The ``kind: llamacpp`` source: a stock llama.cpp server (``llama-server``) read without
engine changes (docs/engines/llamacpp.md).

- ``kind``: the kind's registration (``LlamacppSource``, its keys and rules; imported by
  ``kvledger.collect.sources.kinds``);
- ``source``: the Source (``LlamacppSource``): GET /props, /slots and /metrics through the
  HTTP client, each within what is left of the poll's deadline;
- ``documents``: the JSON of /slots and /props -> validated ``Slot`` and ``Props`` values;
- ``metrics``: the Prometheus text of /metrics (``--metrics``) -> ``ServerMetrics``
  (current builds and the builds before the KV gauges were removed);
- ``mapping``: slots, props and metrics -> engine facts (pure: the bases follow from which
  facts are known).
"""
