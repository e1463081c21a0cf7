"""The per-node checkpoint daemon: in-memory snapshots, buddy replication, durable flush."""
