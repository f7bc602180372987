"""What alerts/ and dashboards/ share, defined once (the monitoring-mixin ``_config``):
join keys, selector helpers and the recording rules. See monitoring/config.py."""
