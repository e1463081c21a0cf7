"""Step-time batching: ranks report every step, the agent ships them per node in batches.

Ranks report faster than the scheduler needs to hear, so samples wait here until the
agent's next batch. The buffer is bounded: when the scheduler link is down for long,
the oldest samples go first (straggler statistics want the recent ones) and the drops
are counted so the loss is visible in the metrics.
"""

from __future__ import annotations

from collections import deque

from pitstop.v1 import agent_pb2

DEFAULT_MAX_SAMPLES = 4096


class StepBatcher:
    """Buffers step samples of every rank on the node until the next `drain`.

    Not thread-safe: used from the agent's event loop only.
    """

    def __init__(self, max_samples: int = DEFAULT_MAX_SAMPLES) -> None:
        if max_samples < 1:
            raise ValueError(f"max_samples {max_samples}: use at least 1")
        self._samples: deque[tuple[str, int, agent_pb2.StepSample]] = deque()
        self._max_samples = max_samples
        self._dropped = 0
        self._newest: dict[str, int] = {}  # job id -> the newest generation it stepped in

    def add(self, job_id: str, generation: int, sample: agent_pb2.StepSample) -> bool:
        """Buffer one sample of `job_id` at `generation`; past `max_samples` the oldest
        buffered sample is dropped and counted. True for the job's first sample in a
        generation newer than any before (it got going: worth reporting at once)."""
        self._samples.append((job_id, generation, sample))
        while len(self._samples) > self._max_samples:
            self._samples.popleft()
            self._dropped += 1
        if generation <= self._newest.get(job_id, -1):
            return False
        if len(self._newest) >= self._max_samples:  # jobs come and go: forget the oldest
            del self._newest[next(iter(self._newest))]
        self._newest[job_id] = generation
        return True

    def drain(self) -> list[agent_pb2.StepTimes]:
        """Every buffered sample, one StepTimes per (job, generation) in order of first
        arrival, samples in arrival order; the buffer is empty afterwards."""
        batches: dict[tuple[str, int], agent_pb2.StepTimes] = {}
        for job_id, generation, sample in self._samples:
            batch = batches.get((job_id, generation))
            if batch is None:
                batch = agent_pb2.StepTimes(job_id=job_id, generation=generation)
                batches[(job_id, generation)] = batch
            batch.samples.append(sample)
        self._samples.clear()
        return list(batches.values())

    @property
    def pending(self) -> int:
        """Samples buffered now."""
        return len(self._samples)

    @property
    def dropped(self) -> int:
        """Samples dropped since start because the buffer was full."""
        return self._dropped
