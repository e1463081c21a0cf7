"""Whether a node daemon is up, and when to start it again: pure bookkeeping over probe
results and process starts and exits, each given with its time.

Three states. UNKNOWN: not answered yet and still within its start grace (a daemon
starting beside the agent is not "down"). UP: it answered the last probe, or missed
fewer than `misses_to_down` in a row. DOWN: that many probes in a row went unanswered
(after the grace), or the process the agent runs exited; it stays DOWN until it
answers again. The cause of a DOWN is fixed when it begins, so the reason the node
reports does not change while the daemon stays down.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Liveness(enum.Enum):
    """What the probes say about a daemon."""

    UNKNOWN = "unknown"
    UP = "up"
    DOWN = "down"


@dataclass
class DaemonLiveness:
    """The state of one daemon, from `answered`, `missed`, `started` and `exited`; each
    returns True when the state changed."""

    misses_to_down: int
    start_grace_seconds: float
    watching_since: float
    state: Liveness = Liveness.UNKNOWN
    misses: int = 0
    cause: str = ""
    """Why it is DOWN, in words; "" otherwise."""
    down_since: float | None = None
    last_answer: float | None = None
    last_start: float | None = None
    """When the agent last started the daemon's process (None: the agent runs none)."""
    unreported: str = ""
    """The cause of an outage not yet taken by `report`."""

    def __post_init__(self) -> None:
        if self.misses_to_down < 1:
            raise ValueError(f"misses_to_down is {self.misses_to_down}; it must be at least 1")

    def answered(self, now: float) -> bool:
        """A probe was answered at `now`."""
        self.misses = 0
        self.last_answer = now
        return self._become(Liveness.UP, "", now)

    def missed(self, now: float, why: str) -> bool:
        """A probe went unanswered at `now`, for the reason `why`."""
        self.misses += 1
        if self.state is Liveness.DOWN or self.misses < self.misses_to_down:
            return False
        if self.state is Liveness.UNKNOWN:
            since = self.last_start if self.last_start is not None else self.watching_since
            if now - since < self.start_grace_seconds:
                return False
            began = "since the agent started it" if self.last_start is not None else "of probes"
            return self._become(
                Liveness.DOWN, f"never answered in {now - since:.0f} s {began}: {why}", now
            )
        return self._become(Liveness.DOWN, f"{self.misses} probes in a row unanswered: {why}", now)

    def started(self, now: float) -> None:
        """The agent started the daemon's process at `now`. A DOWN daemon stays DOWN
        until it answers; an UNKNOWN one gets its start grace from now."""
        self.last_start = now
        self.misses = 0

    def exited(self, now: float, why: str) -> bool:
        """The daemon's process, run by the agent, ended at `now` (`why`: how)."""
        return self._become(Liveness.DOWN, why, now)

    def report(self) -> str:
        """The cause to report now: that of the outage under way, else that of one that
        began and ended since the last report (so every outage is reported at least
        once); "" when there is none."""
        cause = self.cause if self.state is Liveness.DOWN else self.unreported
        self.unreported = ""
        return cause

    def hung(self, now: float, hang_seconds: float, start_seconds: float) -> bool:
        """Whether the process the agent started should be killed as hung: it answered
        since its start and has been silent `hang_seconds` since, or it never answered
        in `start_seconds` (at least `hang_seconds`), which a slow start may need."""
        if self.last_start is None:
            return False
        if self.last_answer is not None and self.last_answer >= self.last_start:
            return now - self.last_answer >= hang_seconds
        return now - self.last_start >= max(hang_seconds, start_seconds)

    def silent_for(self, now: float) -> float:
        """Seconds since the daemon last answered or was last started, whichever is later;
        0 when neither happened."""
        times = [t for t in (self.last_answer, self.last_start) if t is not None]
        return now - max(times) if times else 0.0

    def _become(self, state: Liveness, cause: str, now: float) -> bool:
        if state is self.state:
            return False
        self.state = state
        self.cause = cause
        self.down_since = now if state is Liveness.DOWN else None
        if state is Liveness.DOWN:
            self.unreported = cause
        return True


@dataclass
class RestartBackoff:
    """Delays between restarts of a daemon that keeps dying: `first` after the first
    exit, doubling up to `longest`; back to `first` once a run lasted `stable` seconds."""

    first: float = 0.5
    longest: float = 30.0
    stable: float = 60.0
    _next: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.first <= self.longest:
            raise ValueError(
                f"restart delays {self.first}..{self.longest}: use 0 < first <= longest"
            )
        self._next = self.first

    def after_exit(self, ran_seconds: float) -> float:
        """The delay before the next start, for a process that ran `ran_seconds`."""
        if ran_seconds >= self.stable:
            self._next = self.first
        delay = self._next
        self._next = min(self._next * 2, self.longest)
        return delay
