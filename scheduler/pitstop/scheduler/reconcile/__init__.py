"""The leader's reconcile loop: placing, recovery, steps and stragglers, exits,
standbys, and the command fan-out (see loop.py)."""

from pitstop.scheduler.reconcile.commands import start_command
from pitstop.scheduler.reconcile.context import Timeouts
from pitstop.scheduler.reconcile.loop import Reconciler

__all__ = ["Reconciler", "Timeouts", "start_command"]
