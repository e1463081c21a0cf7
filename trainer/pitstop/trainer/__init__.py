"""The library training scripts import: ranks that pause, swap and resume."""
