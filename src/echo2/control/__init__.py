"""Control plane: the coordinator (registry, heartbeats, leases, ingestion, snapshots, status)."""
