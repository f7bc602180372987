"""The engine-side library: what an engine (or its plugin) embeds to serve kvledger/v1.

- ``reference_ledger``: ``Ledger``, the embeddable reference ledger (admit, allocate,
  share, cache, advance, preempt, release, evict) that renders the kvledger/v1 document;
- ``document_server``: serves a document-rendering function over HTTP or a Unix socket.

Nothing here imports the exporter's collector, policy or outputs.

``__version__`` is the one place the version of both distributions is written: this one's
pyproject.toml reads it, and the daemon's setup.py reads it for the daemon's version and its
exact pin on this library (kvledger and kvledger-engine are released together). Between
releases it is the next version's ``.devN`` (PEP 440), so a build from the tree never reports
a released version (CHANGELOG.md's "Unreleased" section; tests/test_release.py).
"""

__version__ = "0.2.0.dev0"
