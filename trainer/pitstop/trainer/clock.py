"""The step in progress and its time: what a step reports (its wall time less the time
spent in `waiting()`, where ranks wait on each other) and, on a simulated slow GPU, the
stretch the session adds to the work before each collective and at commit."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from pitstop.trainer.context import RankContext


class StepClock:
    """Times one rank's steps; `pending` is the step in progress (None between steps)."""

    def __init__(self, context: RankContext) -> None:
        self._context = context
        self.pending: int | None = None
        self._started = 0.0
        self._mark = 0.0  # end of the last waiting() or the step's start
        self._waited = 0.0  # seconds of this step spent in waiting()
        self.last_wall = 0.0
        """Seconds the last committed step took, waits included."""

    def start(self, step: int) -> None:
        """Step `step` begins now."""
        self.pending = step
        self._started = self._mark = time.perf_counter()
        self._waited = 0.0

    def finish(self) -> float:
        """The pending step is done (the slow GPU's stretch taken first): its seconds of
        work, waits left out. The step is no longer pending."""
        self.simulate_slow_gpu()
        self.pending = None
        self.last_wall = time.perf_counter() - self._started
        return self.last_wall - self._waited

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Wrap a collective (or any wait on other ranks): its time is not this rank's
        work, so it is left out of the step time that straggler detection compares."""
        self.simulate_slow_gpu()
        began = time.perf_counter()
        try:
            yield
        finally:
            self._mark = time.perf_counter()
            self._waited += self._mark - began

    def simulate_slow_gpu(self) -> None:
        """On a simulated slow GPU, stretch the work since the last mark by the
        multiplier: the rank reaches its next collective as late as the slow GPU would."""
        control = self._context.control
        multiplier = control.slow_multiplier if control is not None else 1.0
        if multiplier > 1.0 and self.pending is not None:
            time.sleep((multiplier - 1.0) * (time.perf_counter() - self._mark))
