"""The kvledger/v1 wire format: its JSON schema and its decoder."""
