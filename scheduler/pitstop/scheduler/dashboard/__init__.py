"""The scheduler's read-only web dashboard (see server.py)."""
