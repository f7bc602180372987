"""grafanalib sources of the kvledger dashboards; ``ALL`` lists the builders."""
