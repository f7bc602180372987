"""The ``kind: vllm`` source: a stock vLLM read without engine changes.

- ``kind``: the kind's registration (``VllmSource``, its keys and rules; imported by
  ``kvledger.collect.sources.kinds``);
- ``source``: the Source (``VllmSource``): /metrics through the HTTP client, merged with
  the sub-sources below;
- ``metrics``: vLLM's /metrics text (0.10.2 through current names) -> engine facts;
- ``events_wire``: KV-event payloads (msgpack) decoded;
- ``events_state``: the cached-block multiset per DP rank, its sequence gaps and replays;
- ``events_subscriber``: the ZMQ thread (SUB for events, DEALER for replays);
- ``startup_log``: the startup log's memory profile -> budget terms;
- ``engine_documents``: the in-engine ledger (kvledger_engine.vllm), one document per
  data-parallel rank, read beside /metrics on its own deadline; exact pools and requests
  in place of the bounds, for all ranks or none.
"""
