"""PostgreSQL: typed ORM models, the async engine, migrations at start."""
