"""Grafana dashboards generated with grafanalib (sources in dashboards/src, JSON in dashboards/json)."""
