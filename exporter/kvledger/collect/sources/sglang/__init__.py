"""The ``kind: sglang`` source: SGLang's /metrics (``--enable-metrics``).

- ``metrics``: SGLang's /metrics text (older builds and builds with the kv_* token gauges)
  -> engine facts, tokens turned into pages (kvledger's blocks);
- ``kind``: the kind's registration (``SglangSource``, its keys and rules; imported by
  ``kvledger.collect.sources.kinds``);
- ``source``: the Source (``SglangSource``): /metrics through the HTTP client, plus the
  optional /get_server_info for ``page_size`` on builds that do not export it.
"""
