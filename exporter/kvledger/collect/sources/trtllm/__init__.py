"""The ``kind: trtllm`` source: trtllm-serve's ``GET /prometheus/metrics``.

- ``metrics``: the ``trtllm_*`` exposition -> engine facts (never the JSON ``/metrics``,
  whose every read removes what it returns);
- ``kind``: the kind's registration (``TrtllmSource``, its keys and rules; imported by
  ``kvledger.collect.sources.kinds``);
- ``source``: the Source (``TrtllmSource``).
"""
