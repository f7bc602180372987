"""The engine-side library: what an engine (or its plugin) embeds to serve kvledger/v1.

- ``reference_ledger``: ``Ledger``, the embeddable reference ledger (admit, allocate,
  share, cache, advance, preempt, release, evict) that renders the kvledger/v1 document;
- ``document_server``: serves a document-rendering function over HTTP or a Unix socket.

Nothing here imports the exporter's collector, policy or outputs.
"""
