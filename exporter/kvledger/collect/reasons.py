"""Every reason a source's failure can carry (``kvledger_source_errors_total{reason}``,
``kvledger_source_up``'s log line, ``kvledger check``), with what it means: written once here;
docs/metrics.md is generated from it (``kvledger.tools.docgen``) and a test fails when the code
gives a reason this table does not hold (tests/test_engine_text_hardening.py)."""

from __future__ import annotations

#: reason -> what happened (engine sources first, then the node's own sources)
REASONS: dict[str, str] = {
    "connect": "the engine could not be reached (refused, unreachable, DNS, TLS handshake)",
    "timeout": "no complete answer within timeout_seconds (connect, headers and body together)",
    "http_status": "the engine answered with a status other than 200 (401: it refused the credentials)",
    "too_large": "the answer was over max_response_bytes, or Prometheus text over 50,000 lines; refused before it is parsed",
    "parse": "the answer is not what the kind reads (not Prometheus text, not JSON, a broken value)",
    "schema": "a kvledger/v1 document that breaks its schema",
    "missing": "a series the kind needs is absent from the engine's /metrics",
    "stale": "a kvledger/v1 document that shows running requests but was published more than 30 s ago, by the "
             "server's clock: the engine stopped publishing while its server answers, so its numbers are not given as exact",
    "config": "the configuration cannot be applied to what the engine reports (a credentials file that cannot be read, "
              "a block size the configuration needs and does not give)",
    "invalid": "facts that cannot be accounted or exported (a number beyond 2^53 - 1, not finite, or over a limit)",
    "internal": "a bug of kvledger's: the traceback is logged",
    "unavailable": "a part a source runs itself is down: KV events, the startup log, the in-engine ledger, llama.cpp's /metrics",
    "absent": "NVML: no libnvidia-ml.so.1 on this node",
    "library": "NVML: the library loaded but failed",
    "driver": "NVML: the driver failed or a GPU was lost",
    "disabled": "NVML is off in the configuration (nvml.enabled: false)",
    "proc": "/proc (process attribution or the socket queues of /proc/net/tcp) could not be read",
}
