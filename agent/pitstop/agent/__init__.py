"""The node agent: GPU health, heartbeats, rank supervision."""
