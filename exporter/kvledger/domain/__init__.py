"""What the daemon knows and what it concludes: the facts of a Snapshot, their tables and bounds, and the Accounts."""
