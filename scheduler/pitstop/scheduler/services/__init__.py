"""Domain services: take an explicit database session, do one thing, record its events."""
