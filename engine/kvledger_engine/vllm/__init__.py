"""The in-engine vLLM integration: a vLLM general plugin that serves kvledger/v1.

Enabled by one environment variable of ``vllm serve`` (``KVLEDGER_VLLM_LEDGER``, see
``settings``); inert without it. docs/engines/vllm.md says how to run it.

- ``plugin``: the entry point ``register()`` and the scheduler hooks;
- ``internals``: the only module that reads vLLM's internals (``EngineView``);
- ``tracker``: the incremental pool and request state, and the publication throttle;
- ``document``: publications in, kvledger/v1 bytes out (rendered by the server thread);
- ``engine_core``: one engine core's ledger, tying the above to a ``LedgerServer``;
- ``settings``: the environment variables;
- ``tenant_header``: an ASGI middleware for the API server that carries a tenant header
  into the request (``--middleware kvledger_engine.vllm.tenant_header.TenantHeader``).

Standard library only: vLLM imports none of kvledger's dependencies through it.
"""
