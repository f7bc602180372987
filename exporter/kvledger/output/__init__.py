"""What the Accounts become: the metric catalogue, the Prometheus exposition, OTLP and the JSON view."""
