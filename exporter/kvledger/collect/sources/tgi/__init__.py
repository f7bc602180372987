"""The ``kind: tgi`` source: text-generation-inference's /metrics.

- ``metrics``: the router's ``tgi_*`` gauges -> engine facts: capacity and the running
  batch's reservation in blocks of the ``block_size`` option;
- ``source``: the Source (``TgiSource``).
"""
