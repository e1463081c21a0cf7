"""The library training scripts import: ranks that pause, swap and resume."""

from pitstop.trainer.recovery import PeerLostError
from pitstop.trainer.session import Session
from pitstop.trainer.state import TrainState

__all__ = ["PeerLostError", "Session", "TrainState"]
