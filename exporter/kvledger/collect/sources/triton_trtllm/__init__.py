"""The ``kind: triton-trtllm`` source: Triton's /metrics with the TensorRT-LLM backend.

- ``metrics``: the ``nv_trt_llm_*`` families (both the ``_metrics`` and the first
  ``_statistics`` spellings) -> engine facts, one pool per served TensorRT-LLM model;
- ``kind``: the kind's registration (``TritonTrtllmSource``, its keys and rules; imported by
  ``kvledger.collect.sources.kinds``);
- ``source``: the Source (``TritonTrtllmSource``).
"""
