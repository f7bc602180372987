"""The ``ledger`` engine kind (a kvledger/v1 document read as it is): ``kind.py``, its
registration. Its source is ``kvledger.collect.sources.document.LedgerSource``, which the
vLLM and SGLang kinds also use for their in-engine ledgers."""
