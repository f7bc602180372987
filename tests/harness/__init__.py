"""Reusable helpers for tests that start real Prometheus-ecosystem processes.

- ``harness.process``: a managed child process with a log file, readiness polling and
  clean shutdown; ``free_port()``.
- ``harness.prometheus``: start a real Prometheus on a free port with given scrape
  targets, rule files and Alertmanagers; query it through its HTTP API.
- ``harness.alertmanager``: start a real Alertmanager with a given configuration.
- ``harness.webhook``: an in-process HTTP receiver for Alertmanager webhook payloads.

Tests import them as ``from harness.prometheus import start_prometheus`` (pytest puts
``tests/`` on ``sys.path`` because ``tests/`` is not a package).
"""
