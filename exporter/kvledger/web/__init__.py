"""The HTTP server: connections, endpoints, the exporter-toolkit web config (TLS, basic auth) and the pages."""
