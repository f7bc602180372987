"""The ``kind: tgi`` source: text-generation-inference's /metrics.

- ``metrics``: the router's ``tgi_*`` gauges -> engine facts: capacity and the running
  batch's reservation in blocks of the ``block_size`` option;
- ``kind``: the kind's registration (``TgiSource``, its keys and rules; imported by
  ``kvledger.collect.sources.kinds``);
- ``source``: the Source (``TgiSource``).
"""
