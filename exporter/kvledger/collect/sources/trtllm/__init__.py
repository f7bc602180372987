"""The ``kind: trtllm`` source: trtllm-serve's ``GET /prometheus/metrics``.

- ``metrics``: the ``trtllm_*`` exposition -> engine facts (never the JSON ``/metrics``,
  whose every read removes what it returns);
- ``source``: the Source (``TrtllmSource``).
"""
